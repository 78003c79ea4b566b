"""The prompt sets' shapes and the repetition-loop detector (benchmarks/peer_bench/); no model servers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


@pytest.fixture(autouse=True)
def bench_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "models" / "default" / "target")


def prompt_of(item) -> str:
    from peer_bench.workload import Conversation, Request

    return item.first if isinstance(item, Conversation) else item.prompt if isinstance(item, Request) else item


def test_every_set_is_deterministic_distinct_and_fits_the_context_with_128_new_tokens(tok):
    from peer_bench.heldout import context_of
    from peer_bench.prompts import PROMPT_SETS

    assert context_of(tok) == 512
    for name, build in PROMPT_SETS.items():
        items = build(tok, 6)
        assert items == build(tok, 6) and len({prompt_of(x) for x in items}) == 6, name
        assert all(len(tok.encode(prompt_of(x))) + 128 <= 512 for x in items), name


def test_agentic_turn_2_resends_turn_1_prompt_and_output_then_asks_again(tok):
    from peer_bench.agentic import AGAIN, agentic_prompts

    conv = agentic_prompts(tok, 2)[0]
    snippet = conv.first.split(AGAIN)[0]
    output = "    Num: (int, float),\n}"
    turn2 = conv.next_prompt(conv.first, output)
    assert turn2.startswith(conv.first + output) and turn2.endswith(AGAIN + snippet.split("\n", 1)[0])
    assert conv.turns == 3


def test_every_agentic_last_turn_fits_the_context_even_where_a_snippet_must_be_cut_or_dropped(tok):
    from peer_bench.agentic import RESEND_SLACK, agentic_prompts, fitted, snippet_tokens
    from peer_bench.heldout import snippets

    # 300 conversations: 8 of their first 300 snippets have a first line too long to fit (16 of 100 last turns
    # overflowed the context, a 400 for both servers, before the follow-up and the resent outputs were counted)
    convs = agentic_prompts(tok, 300)
    assert len({c.first for c in convs}) == 300
    for conv in convs:
        follow_up = len(tok.encode(conv.follow_up))
        assert len(tok.encode(conv.first)) + 2 * (128 + RESEND_SLACK + follow_up) + 128 <= 512
    drawn = snippets(tok, 300, snippet_tokens(512))
    assert any(fitted(tok, s, 512) is None for s in drawn)
    long_line = "x = [" + ", ".join(str(i) for i in range(400)) + "]"
    assert fitted(tok, long_line, 512) is None
    cut = fitted(tok, "def f():\n" + "\n".join(f"    y{i} = {i}" for i in range(200)), 512)
    assert cut is not None and cut.first.startswith("def f():\n    y0 = 0\n")


def test_the_client_builds_each_turn_from_the_previous_turns_output_in_order():
    import httpx
    from peer_bench.client import _serve
    from peer_bench.workload import Conversation

    seen: list[str] = []

    def reply(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["prompt"]
        seen.append(prompt)
        chunk = json.dumps({"choices": [{"text": f"<out{len(seen)}>"}]})
        return httpx.Response(200, text=f"data: {chunk}\n\ndata: [DONE]\n\n")

    conv = Conversation(first="P", turns=3, follow_up="|again|")
    results = asyncio.run(_serve("http://x", "m", [conv], 8, 4, transport=httpx.MockTransport(reply)))
    assert [r.text for r in results] == ["<out1>", "<out2>", "<out3>"]
    assert seen == ["P", "P<out1>|again|", "P<out1>|again|<out2>|again|"]


def test_code_newline_prompts_are_the_code_prompts_ending_at_a_bare_newline(tok):
    from peer_bench.prompts import code_newline_prompts, code_prompts

    newline = code_newline_prompts(tok, 4)
    assert newline == [p + "\n" for p in code_prompts(tok, 4)]
    assert all(p.endswith("\n") and not p.endswith("\n\n") for p in newline)


def test_random_prompts_are_reproducible_and_do_not_depend_on_how_many_are_asked_for(tok):
    from peer_bench.random_tokens import random_prompts

    five = random_prompts(tok, 5)
    assert five == random_prompts(tok, 5) and random_prompts(tok, 2) == five[:2] and len(set(five)) == 5


def test_extraction_requests_carry_one_json_schema_over_different_held_out_functions(tok):
    from peer_bench.extraction import ASK, RESPONSE_FORMAT, extraction_prompts

    from recipe.corpus import split, stdlib_files

    reqs = extraction_prompts(tok, 6)
    assert all(r.extra == {"response_format": RESPONSE_FORMAT} for r in reqs)
    assert RESPONSE_FORMAT["type"] == "json_schema" and "schema" in RESPONSE_FORMAT["json_schema"]
    assert len({r.prompt for r in reqs}) == 6 and all(r.prompt.endswith(ASK) for r in reqs)
    held_out = "\n".join(f.read() for f in split(stdlib_files())[1])
    for r in reqs:
        assert r.prompt.removesuffix(ASK).split("\n", 1)[0].strip() in held_out


def test_quoting_prompts_end_with_the_def_line_of_a_function_they_contain(tok):
    from peer_bench.quoting import DEF, quoting_prompts

    for p in quoting_prompts(tok, 4):
        body, comment, line = p.rsplit("\n", 2)
        if DEF.match(line):
            assert comment == f"# the function {DEF.match(line).group(1)} again:" and line in body
        assert len(tok.encode(body)) >= 300


def test_a_quoting_prompt_whose_last_line_is_long_is_cut_to_leave_room_for_the_copy(tok):
    from peer_bench.heldout import context_of
    from peer_bench.quoting import ROOM, fitted

    text = "x = 1\ndef f(a):\n    return a\n" + "y = " + " + ".join(["1"] * 400)
    prompt = fitted(tok, text, "def f(a):", "\n\n# the function f again:\ndef f(a):", context_of(tok) - ROOM)
    assert len(tok.encode(prompt)) <= context_of(tok) - ROOM
    assert prompt.startswith("x = 1\ndef f(a):\n    return a") and prompt.endswith("again:\ndef f(a):")
    assert fitted(tok, "def f(a):\n    return a", "def f(a):", "\nask", 500) == "def f(a):\n    return a\nask"


def test_a_looping_text_is_flagged_and_a_non_looping_one_is_not(tok):
    from peer_bench.loops import is_loop

    loop = "def f(x):\n    return x\n" + "    return x\n" * 30
    assert is_loop(tok.encode(loop))
    assert is_loop(tok.encode("The result is " + "the same " * 40))
    prose = ("Return a new list of the items in the iterable, sorted by key; the sort is stable, so items "
             "that compare equal keep their order. Raises TypeError when two items cannot be compared.")
    assert not is_loop(tok.encode(prose))
    counting = "".join(f"x{i} = {i}\n" for i in range(40))  # repeats in shape, not in tokens
    assert not is_loop(tok.encode(counting))
    assert not is_loop([7] * 10)  # too short to tell

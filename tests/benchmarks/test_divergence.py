"""benchmarks/peer_bench/divergence.py: which texts differ from the baseline's, and the target's verdict on each."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "models" / "default" / "target"


@pytest.fixture(autouse=True)
def bench_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))


def test_a_conversations_later_turns_are_sent_its_earlier_outputs():
    from peer_bench.divergence import sent_prompts
    from peer_bench.workload import Conversation, Request

    conv = Conversation(first="a", turns=3, follow_up="?")
    got = sent_prompts(["p", conv, Request("q", {"x": 1})], ["P", "1", "2", "3", "Q"])
    assert got == ["p", "a", "a1?", "a1?2?", "q"]
    assert sent_prompts([conv], ["1", None, None]) == ["a", "a1?", None], "after a failed turn nothing was sent"


def test_a_turn_sent_another_prompt_follows_the_difference_before_it():
    from peer_bench.divergence import differences

    got = differences(["a", "a1?", "x"], ["1", "2", "same"], ["a", "a9?", "x"], ["9", "2b", "same"])
    assert [(c["index"], c["kind"]) for c in got] == [(0, "unjudged"), (1, "follows an earlier difference")]
    assert got[0]["prompt"] == "a" and got[1]["prompt"] is None


@pytest.fixture(scope="module")
def judge():
    from peer_bench.divergence import Judge

    return Judge(TARGET)


def greedy(judge, prompt: str, n: int) -> list[int]:
    import torch

    ids = judge.tok.encode(prompt)
    with torch.no_grad():
        out = judge.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_a_difference_where_the_target_is_decided_is_unexplained(judge):
    import torch

    prompt = "def add(a, b):\n    return"
    ids = greedy(judge, prompt, 6)
    with torch.no_grad():
        logits = judge.model(torch.tensor([judge.tok.encode(prompt) + ids[:3]])).logits[0, -1]
    runner_up = int(torch.topk(logits, 2).indices[1])
    other = ids[:3] + [runner_up]
    case = {"kind": "unjudged", "prompt": prompt, "text": judge.tok.decode(other),
            "baseline_text": judge.tok.decode(ids)}
    judge(case)
    assert case["token"] == 3 and case["follows"] == "baseline"
    assert case["kind"] == "unexplained" and case["top2_gap"] == pytest.approx(
        float(logits[ids[3]] - logits[runner_up]), abs=1e-4)


def test_a_difference_on_a_near_tie_is_excused(judge, monkeypatch):
    from peer_bench import divergence

    prompt = "import os\n"
    ids = greedy(judge, prompt, 4)
    monkeypatch.setattr(divergence, "NEAR_TIE", 1e9)  # every gap is a tie: the verdict follows the threshold
    case = {"kind": "unjudged", "prompt": prompt, "text": judge.tok.decode(ids[:2]),
            "baseline_text": judge.tok.decode(ids)}
    judge(case)
    assert case["kind"] == "near-tie" and case["token"] == 2 and case["follows"] == "baseline"
    done = dict(case)
    judge(case)
    assert case == done, "a judged case is left as it is"

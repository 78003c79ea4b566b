"""Scoring a text over HTTP, as evaluation harnesses do: echo + logprobs (max_tokens 0 included), vLLM's
prompt_logprobs on both routes, /tokenize, /detokenize and /tokenizer_info, through the official openai client.

Every prompt logprob is checked against a plain transformers forward of the prompt alone, in float32 like the
server: the engine computes them in its own packed, chunked, paged forward, so they agree to rounding (1e-4).
"""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from server.config import ServerConfig
from tests.server.conftest import MODEL, LiveServer, tiny_engine

pytestmark = pytest.mark.timeout(120)

TOL = 1e-4
PROMPT = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"


@pytest.fixture(scope="module")
def live(model_sets, chat_target):
    """A drafting server with small blocks (the prefix cache has whole blocks to share) and chunks of 8 prompt
    tokens per step, so a prompt is scored over several chunked forwards."""
    engine = tiny_engine(chat_target, model_sets["llama"].draft, k=4, block_size=4, max_num_batched_tokens=16)
    server = LiveServer(ServerConfig(model=str(chat_target), draft_model=str(model_sets["llama"].draft),
                                     served_model_name=MODEL, max_logprobs=5), engine)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(chat_target):
    model = AutoModelForCausalLM.from_pretrained(chat_target, dtype=torch.float32).eval()

    @torch.inference_mode()
    def logprobs(ids: list[int]) -> torch.Tensor:  # [P - 1]: token i + 1 given tokens 0..i
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        return logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]

    return logprobs


@pytest.fixture(scope="module")
def tok(chat_target):
    return PreTrainedTokenizerFast.from_pretrained(chat_target)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(live, reference, tok):
    resp = live.client().completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    choice, ids = resp.choices[0], tok.encode(PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), reference(ids), atol=TOL)
    for got, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert 1 <= len(top) <= 2 and max(top.values()) >= got - TOL  # the best alternative is at least as likely


def test_batched_token_id_prompts_are_scored_each_as_if_alone(live, reference):
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [40, 41, 42, 43, 40, 41, 42]]
    resp = live.client().completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=0, max_tokens=0)
    for ids, choice in zip(prompts, sorted(resp.choices, key=lambda c: c.index)):
        assert torch.allclose(torch.tensor(choice.logprobs.token_logprobs[1:]), reference(ids), atol=TOL)


def test_vllms_prompt_logprobs_carry_ids_ranks_and_decoded_tokens_on_both_routes(live, reference, tok):
    client, ids = live.client(), tok.encode(PROMPT)
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body={"prompt_logprobs": 3})
    entries = resp.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    want = reference(ids)
    for i, entry in enumerate(entries[1:]):
        own = entry[str(ids[i + 1])]
        assert abs(own["logprob"] - float(want[i])) < TOL and own["decoded_token"] == tok.decode([ids[i + 1]])
        best = [e for e in entry.values() if e["rank"] == 1]
        assert len(best) == 1 and best[0]["logprob"] >= own["logprob"] - TOL and own["rank"] >= 1
        assert len(entry) in (3, 4)  # the top 3, and the prompt's own token when it is not among them
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    scored = chat.model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == chat.usage.prompt_tokens and all(len(e) == 1 for e in scored[1:])


def test_scoring_the_prompt_leaves_the_speculative_output_and_the_prefix_cache_as_they_were(live):
    client = live.client()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw)
    again = client.completions.create(**kw)  # the prompt's blocks are cached now
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    scored = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "prompt_logprobs": 1}})
    assert scored.choices[0].text == plain.choices[0].text  # speculation (4 drafts a step) unchanged
    cached = scored.usage.prompt_tokens_details
    assert cached is None or not cached.cached_tokens  # it computed its whole prompt: no cached logits exist
    after = client.completions.create(**kw)
    assert after.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens


def test_streaming_echo_sends_the_scored_prompt_first(live, reference, tok):
    chunks = list(live.client().completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                                                   temperature=0, stream=True))
    first = next(c for c in chunks if c.choices and c.choices[0].logprobs)
    lp, ids = first.choices[0].logprobs, tok.encode(PROMPT)
    assert first.choices[0].text.startswith(PROMPT) and lp.token_logprobs[0] is None
    assert torch.allclose(torch.tensor(lp.token_logprobs[1 : len(ids)]), reference(ids), atol=TOL)


@pytest.mark.parametrize(("body", "param"), [
    (dict(prompt=PROMPT, max_tokens=0), "max_tokens"),  # nothing to return without echo
    (dict(prompt=PROMPT, logprobs=6), "logprobs"),  # over --max-logprobs 5
    (dict(prompt=PROMPT, max_tokens=1, prompt_logprobs=6), "prompt_logprobs"),
    (dict(prompt=PROMPT, max_tokens=1, prompt_logprobs=2, token_healing=True), "prompt_logprobs"),
    (dict(prompt="word " * 2000, echo=True, logprobs=1, max_tokens=0), "prompt"),  # past the context
])
def test_bad_scoring_requests_get_a_400_naming_the_field_and_the_server_goes_on(live, body, param):
    r = live.post("/v1/completions", {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert param in (r.json()["error"].get("param") or "") or param in r.json()["error"]["message"], r.text
    assert live.client().completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].finish_reason


def test_tokenize_and_detokenize_agree_with_what_generation_feeds(live, tok):
    client = live.client()
    r = live.post("/tokenize", {"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    usage = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage
    assert r["tokens"] == tok.encode(PROMPT) and r["count"] == usage.prompt_tokens == len(r["token_strs"])
    assert r["max_model_len"] == live.get("/v1/models").json()["data"][0]["max_model_len"]
    messages = [{"role": "user", "content": "hello there"}]
    chat = live.post("/tokenize", {"messages": messages}).json()
    sent = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat["count"] == sent.usage.prompt_tokens
    bare = live.post("/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"]  # without "assistant:"
    assert live.post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": PROMPT}
    info = live.get("/tokenizer_info").json()
    assert info["tokenizer_class"] and info["max_model_len"] == r["max_model_len"] and info["chat_template"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"model": MODEL}, "prompt"),  # neither prompt nor messages
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),  # both
    ("/tokenize", {"prompt": "a", "model": "another-model"}, "model"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
])
def test_bad_tokenizer_requests_get_a_400_naming_the_field(live, path, body, param):
    r = live.post(path, body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert param in (error.get("param") or "") or param in error["message"], r.text


def test_the_tokenizer_routes_sit_behind_the_api_key(make_server):
    url = make_server(api_key="secret").url
    for key, status in (("wrong", 401), ("secret", 200)):
        r = httpx.post(url + "/tokenize", json={"prompt": "a"}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == status, r.text


def test_the_openai_client_scores_through_the_legacy_route_like_lm_eval_does(live, reference):
    """lm-evaluation-harness's local-completions loglikelihood: token ids in, echo, logprobs 1, max_tokens 0, and it
    sums token_logprobs over the continuation."""
    context, continuation = [5, 6, 7, 8, 9, 5, 6], [7, 8, 9]
    resp = live.client().completions.create(model=MODEL, prompt=[context + continuation], echo=True, logprobs=1,
                                            max_tokens=0, temperature=0)
    got = sum(resp.choices[0].logprobs.token_logprobs[len(context):])
    assert abs(got - float(reference(context + continuation)[len(context) - 1 :].sum())) < 10 * TOL

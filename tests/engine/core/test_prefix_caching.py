"""Prefix caching end to end: a request whose prompt starts with what an earlier one computed reuses
those KV blocks (the target's and the draft model's) and its output is what a cold run gives, for
every drafter, under small budgets, preemption, abort, and a sliding-window model."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.worker.forward_batch import ForwardBatch
from tests.engine.lossless import Reference, assert_equal_unless_near_tie, assert_same_sample_unless_near_tie
from tests.tiny_models import EOS

BLOCK = 8
MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def shared_prefix_prompts(n: int = 4, prefix_len: int = 43) -> list[list[int]]:
    """A few-shot style prefix (with repetition, so lookup has matches) and a different tail each."""
    rnd = random.Random(7)
    prefix = [rnd.randrange(3, 200) for _ in range(-(-prefix_len // 2))]
    prefix = (prefix + prefix)[:prefix_len]
    return [prefix + [rnd.randrange(3, 200) for _ in range(3 + i)] for i in range(n)]


def llm_for(ms, method: str, k: int | None, **kw) -> LLM:
    return LLM(
        model=str(ms.target), draft_model=str(ms.draft) if method in ("draft_model", "hybrid") else None,
        speculative_method=method, num_speculative_tokens=k, dtype="float32", device="cpu", block_size=BLOCK, **kw,
    )


class Watch:
    """Counts the prefix cache's hits and the prompt tokens the target was fed, and checks every target forward
    writes K/V only into blocks that are not in the cache (a registered block may have other readers)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.hits = self.queries = self.prompt_fed = 0
        bm, forward, step = engine.block_manager, engine.target.forward, engine.step

        def checked_forward(batch: ForwardBatch):  # noqa: ANN202
            for ids, start, table in zip(batch.token_ids, batch.starts, batch.block_tables):
                written = {table[p // bm.block_size] for p in range(start, start + len(ids))}
                cached = written & set(bm._hash_of)  # noqa: SLF001
                assert not cached, f"the target wrote into cached blocks {cached}"
            return forward(batch)

        def counted_step():  # noqa: ANN202
            outputs = step()
            if engine.last_step is not None:
                self.hits += engine.last_step.prefix_cache_hits
                self.queries += engine.last_step.prefix_cache_queries
                self.prompt_fed += engine.last_step.num_prompt_tokens
            return outputs

        engine.target.forward = checked_forward
        engine.step = counted_step


@pytest.fixture(scope="module")
def refs(model_sets) -> dict[str, Reference]:
    return {arch: Reference(model_sets[arch].target) for arch in ("llama", "mistral")}


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: a sliding window (24) shorter than the prompts
@pytest.mark.parametrize(
    ("method", "k", "kw"),
    [
        ("none", None, {}),
        ("draft_model", 4, {}),
        ("draft_model", None, {"max_num_batched_tokens": 12}),  # hits, then a chunked rest and catch-up
        ("ngram", 4, {}),
        ("hybrid", None, {}),
    ],
    ids=["none", "draft_model-k4", "draft_model-adaptive-budget12", "ngram-k4", "hybrid-adaptive"],
)
def test_a_warm_prefix_gives_the_cold_greedy_output_for_every_drafter(arch, method, k, kw, model_sets, refs):
    ref, prompts = refs[arch], shared_prefix_prompts()
    llm = llm_for(model_sets[arch], method, k, **kw)
    watch = Watch(llm.engine)
    first = llm.generate(prompts[:1], GREEDY)  # computes the prefix
    assert watch.hits == 0
    rest = llm.generate(prompts[1:], GREEDY)  # the same prefix, other tails: reused
    prefix_blocks = 43 // BLOCK
    assert watch.hits >= 3 * prefix_blocks * BLOCK, f"{watch.hits} tokens reused"
    again = llm.generate(prompts, GREEDY)  # prompt and all: the whole prompt but its last token is cached
    for label, outs, ps in (("cold", first, prompts[:1]), ("shared prefix", rest, prompts[1:]),
                            ("repeated", again, prompts)):
        for p, o in zip(ps, outs):
            assert_equal_unless_near_tie(ref, p, o.token_ids, ref.greedy(p, MAX_NEW), f"{arch} {method} {label}")


def test_n_choices_of_one_prompt_compute_it_once(model_sets, refs):
    """Three requests for one prompt arriving together: the second and third wait one step for the
    first's prefill, then reuse its blocks."""
    llm = llm_for(model_sets["llama"], "draft_model", 4)
    watch = Watch(llm.engine)
    prompt = shared_prefix_prompts(1)[0]  # 46 tokens: 5 full blocks of 8 reusable
    outs = llm.generate([prompt] * 3, GREEDY)
    assert watch.hits == 2 * 5 * BLOCK
    assert watch.prompt_fed == 46 + 2 * 6  # the whole prompt once, then each sibling's 6 uncached tokens
    assert [o.token_ids for o in outs[1:]] == [outs[0].token_ids] * 2
    assert_equal_unless_near_tie(refs["llama"], prompt, outs[0].token_ids, refs["llama"].greedy(prompt, MAX_NEW),
                                 "n = 3")
    cold = llm_for(model_sets["llama"], "draft_model", 4, prefix_caching=False)
    cold_watch = Watch(cold.engine)
    cold.generate([prompt] * 3, GREEDY)
    assert (cold_watch.hits, cold_watch.prompt_fed) == (0, 3 * 46)


def test_the_draft_model_reuses_the_draft_cache_of_a_prefix_it_computed(model_sets):
    llm = llm_for(model_sets["llama"], "draft_model", 4)
    engine = llm.engine
    prompts = shared_prefix_prompts(2)
    llm.generate(prompts[:1], GREEDY)
    engine.add_request("second", prompts[1], GREEDY)
    engine.step()
    seq = engine.seqs["second"]
    # The first step prefills the uncached tail; the draft model has not run for it yet, so its cache
    # is valid as far as the blocks it came with (the first request's draft computed them), not from 0.
    assert seq.prefix.cached_tokens == 5 * BLOCK
    assert seq.draft_num_computed == 5 * BLOCK
    while engine.has_unfinished():
        engine.step()


def test_seeded_sampling_is_the_same_with_the_prefix_cold_or_warm(model_sets, refs):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_p=0.95, seed=11, ignore_eos=True)
    prompt = shared_prefix_prompts(1)[0]
    llm = llm_for(model_sets["llama"], "hybrid", None)
    cold = llm.generate([prompt], params)[0].token_ids
    warm = llm.generate([prompt], params)[0].token_ids
    assert_same_sample_unless_near_tie(refs["llama"], prompt, warm, cold, 11, 1.0, 0.95, "warm vs cold")


def test_preemption_abort_and_eviction_leave_every_block_free_and_outputs_exact(model_sets, refs):
    """A cache of 14 blocks of 8 for eight requests sharing a 43-token prefix: blocks are shared,
    preempted, evicted and aborted under readers; at the end nothing is held and the survivors are exact."""
    llm = llm_for(model_sets["llama"], "hybrid", 4, num_kv_blocks=14, max_model_len=96)
    engine, bm = llm.engine, llm.engine.block_manager
    watch = Watch(engine)
    prompts = shared_prefix_prompts(8)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)  # all 40: more pressure
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
        outs[str(i)] = []
    preempted, steps, aborted = 0, 0, {"2", "5"}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].extend(out.new_token_ids)
        steps += 1
        preempted += engine.last_step.num_preempted if engine.last_step else 0
        if steps == 6:
            for rid in aborted:
                engine.abort(rid)
        held = [b for s in engine.seqs.values() for b in s.block_table]
        for b in set(held):
            assert bm.refs(b) == held.count(b), f"block {b}: refcount {bm.refs(b)}, held {held.count(b)} times"
    assert preempted > 0 and watch.hits > 0, f"preempted {preempted}, reused {watch.hits} tokens"
    assert bm.num_free_blocks == bm.num_blocks and all(bm.refs(b) == 0 for b in range(bm.num_blocks))
    for i, p in enumerate(prompts):
        if str(i) not in aborted:
            want = refs["llama"].greedy(p, 40)  # ends at EOS, where these requests went on
            got = outs[str(i)][: len(want)] if want[-1] == EOS else outs[str(i)]
            assert_equal_unless_near_tie(refs["llama"], p, got, want, f"request {i}")

"""Suffix decoding: the per-request and global indexes (engine.speculative.suffix) and the engine around them."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.speculative.source import DraftRequest
from engine.speculative.suffix import GlobalSuffixCache, SuffixSource
from engine.speculative.suffix_index import Stream
from engine.speculative.suffix_native import NativeStream, native_available
from engine.types.sampling_params import SamplingParams as Params
from engine.types.sequence import Sequence
from tests.engine.lossless import MAX_NEW, Reference, assert_same_as_target
from tests.engine.speculative.test_suffix_index import holds, substring_counts

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def seq(name: str, prompt: list[int], output: list[int] = ()) -> Sequence:  # type: ignore[assignment]
    s = Sequence(name, list(prompt), Params())
    s.token_ids.extend(output)
    return s


def test_a_request_drafts_from_its_own_prompt():
    source = SuffixSource(max_requests=10, max_draft=24)
    a = seq("a", [1, 2, 3, 4, 5, 6, 9, 1, 2, 3])
    assert source.propose([DraftRequest(a, 8)]).tokens == [[4, 5, 6]]  # a 3-token match drafts up to 3
    assert source.propose([DraftRequest(a, 2)]).probs is None  # one-hot, like prompt lookup
    assert source.propose([DraftRequest(a, 2)]).tokens == [[4, 5]]


def test_an_ended_requests_output_drafts_for_a_later_one():
    source = SuffixSource(max_requests=10, max_draft=24)
    a = seq("a", [7, 7], [1, 2, 3, 4, 5, 6, 7, 8])
    source.propose([DraftRequest(a, 4)])
    source.release(a)
    b = seq("b", [9, 1, 2, 3, 4])  # nothing in its own prompt to match
    assert source.propose([DraftRequest(b, 8)]).tokens == [[5, 6, 7, 8]]


def test_a_running_request_helps_its_neighbours():
    source = SuffixSource(max_requests=10, max_draft=24)
    a = seq("a", [7], [1, 2, 3, 4, 5, 6])
    source.propose([DraftRequest(a, 4)])  # a's tokens but its last are in the global index now
    b = seq("b", [9, 1, 2, 3])
    assert source.propose([DraftRequest(b, 8)]).tokens == [[4, 5]]  # 6, a's last, is not indexed yet


def test_the_better_scoring_of_the_two_drafts_wins():
    source = SuffixSource(max_requests=10, max_draft=24)
    for name in "xyz":  # three earlier outputs continue [1, 2] with 3
        s = seq(name, [0], [1, 2, 3])
        source.propose([DraftRequest(s, 1)])
        source.release(s)
    own = seq("own", [1, 2, 8, 1, 2, 9, 1, 2])  # its own prompt: 8 or 9 after [1, 2], half each
    assert source.propose([DraftRequest(own, 1)]).tokens == [[3]]  # global: probability 1 beats 1/2
    lone = seq("lone", [1, 2, 8, 1, 2, 8, 1, 2, 8, 1, 2])  # its own: 8 three times of three
    shared = source.cache.index.draft(lone.token_ids, 2, 0.1, 1.0, 0.0)
    assert shared[0] == [3]
    assert source.propose([DraftRequest(lone, 2)]).tokens == [[8, 1]]  # own: 1 + 1 beats global's 1


def test_the_global_index_keeps_the_latest_ended_requests_only():
    cache = GlobalSuffixCache(max_requests=2, depth=6)
    outputs = [[1, 2, 3, 4], [2, 3, 5, 5, 2], [7, 2, 3, 1], [4, 4, 4]]
    for out in outputs:
        stream = cache.open()
        cache.index.extend(stream, out)
        cache.close(stream)
    assert not cache.live and len(cache.ended) == 2
    assert holds(cache.index, substring_counts(outputs[2:], 6))
    assert cache.num_nodes == len(substring_counts(outputs[2:], 6))


def test_release_inserts_the_rest_of_the_output_once_and_forgets_the_request():
    source = SuffixSource(max_requests=5, max_draft=24)
    a = seq("a", [1, 2], [3, 4])
    source.propose([DraftRequest(a, 2)])
    a.token_ids.extend([5, 6])
    source.release(a)
    source.release(a)  # twice (an abort racing a finish): nothing more
    assert not source.cache.live
    assert holds(source.cache.index, substring_counts([[3, 4, 5, 6]], 24))
    assert seq("b", [9]).draft.suffix is None and source.propose([DraftRequest(seq("c", [3]), 3)]).tokens == [[4]]


def test_a_request_whose_token_list_was_preempted_and_recomputed_is_not_inserted_twice():
    """Preemption keeps a sequence's tokens and its draft state: only tokens not yet seen are inserted."""
    source = SuffixSource(max_requests=5, max_draft=24)
    a = seq("a", [1, 2, 3], [4, 5])
    source.propose([DraftRequest(a, 2)])
    a.reset_for_recompute()
    source.propose([DraftRequest(a, 2)])
    a.token_ids.append(6)
    source.propose([DraftRequest(a, 2)])
    source.release(a)
    assert holds(source.cache.index, substring_counts([[4, 5, 6]], 24))
    assert a.draft.suffix is not None and a.draft.suffix.synced == 6
    assert holds(a.draft.suffix.index, substring_counts([[1, 2, 3, 4, 5, 6]], 24))


# ---- the engine ----------------------------------------------------------------------------------------------


def suffix_llm(target, **kwargs) -> LLM:  # noqa: ANN001
    return LLM(model=str(target), speculative_method="suffix", dtype="float32", device="cpu", block_size=4, **kwargs)


# Fixed k: adaptive k prices drafts from start-up timings, which a busy host can make too dear to draft at all
# (the lossless matrix runs suffix decoding with adaptive k).
@pytest.mark.parametrize("k", [4, 8])
def test_repeated_prompts_draft_from_the_earlier_requests_output_and_stay_lossless(k, model_sets):
    ms = model_sets["llama"]
    ref = Reference(ms.target)
    llm = suffix_llm(ms.target, num_speculative_tokens=k)
    source = llm.engine.drafting.source("suffix")
    prompt = [20 + 23 * i for i in range(12)]  # nothing repeats within it
    first = llm.generate([prompt], GREEDY)[0]
    assert_same_as_target(ref, prompt, first.token_ids, "first")
    steps = llm.stats().num_steps
    again = llm.generate([prompt], GREEDY)[0]
    assert again.token_ids == first.token_ids
    # The second time, the global index holds the first output: drafts from it take far fewer steps.
    steps, first_steps = llm.stats().num_steps - steps, steps
    assert steps < first_steps / 2, (steps, first_steps)
    accepted = llm.stats().by_source["suffix"].num_accepted_tokens
    batch = [prompt, [5, 6, 7, 8, 9, 5, 6, 7], prompt, [250] * 9]
    for p, out in zip(batch, llm.generate(batch, GREEDY)):
        assert_same_as_target(ref, p, out.token_ids, "batch of 4")
    assert llm.stats().by_source["suffix"].num_accepted_tokens > accepted
    assert not source.cache.live and len(source.cache.ended) == 6
    assert source.cache.num_nodes > 0


def test_an_aborted_request_leaves_the_indexes_consistent(model_sets):
    llm = suffix_llm(model_sets["llama"].target, num_speculative_tokens=4)
    engine, source = llm.engine, llm.engine.drafting.source("suffix")
    engine.add_request("a", [5, 6, 7, 8, 9, 5, 6, 7], GREEDY)
    engine.add_request("b", [40, 41, 42, 43, 40, 41], GREEDY)
    for _ in range(4):
        engine.step()
    a = engine.seqs["a"]
    assert engine.abort("a")
    assert len(source.cache.live) == 1 and list(source.cache.ended)[0].tokens == a.output_token_ids
    while engine.has_unfinished():
        engine.step()
    assert not source.cache.live
    outputs = [s.tokens for s in source.cache.ended]
    assert holds(source.cache.index, substring_counts(outputs, 24))


def test_preempted_requests_stay_lossless_and_are_indexed_once(model_sets, tokenizer_dir):
    """19 blocks of 4 tokens hold about one and a half sequences: eight at once must preempt."""
    from tests.engine.lossless import prompts_for

    ms = model_sets["llama"]
    ref = Reference(ms.target)
    llm = suffix_llm(ms.target, num_speculative_tokens=4, max_model_len=64, num_kv_blocks=19)
    engine, source = llm.engine, llm.engine.drafting.source("suffix")
    prompts = prompts_for(tokenizer_dir)
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
        outs[str(i)] = []
    preempted = 0
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].extend(out.new_token_ids)
        preempted += engine.last_step.num_preempted if engine.last_step else 0
    assert preempted > 0, "the cache was large enough that nothing was preempted"
    for i, p in enumerate(prompts):
        assert_same_as_target(ref, p, outs[str(i)], f"preempted request {i}")
    assert not source.cache.live
    assert holds(source.cache.index, substring_counts(list(outs.values()), 24))
    assert llm.stats().by_source["suffix"].num_accepted_tokens > 0


def test_the_index_stream_type_is_what_the_draft_state_holds():
    s = seq("a", [1, 2, 1])
    SuffixSource(max_requests=1, max_draft=4).propose([DraftRequest(s, 2)])
    assert isinstance(s.draft.suffix.own, NativeStream if native_available() else Stream)  # type: ignore[union-attr]

"""Static bucket shapes (engine.worker.graphs): padding never changes an output, on every device present.

On CPU the padded forward runs eagerly; where CUDA is present the same cases run again on it with
the forwards captured and replayed as CUDA graphs (CI has no GPU; the device machine runs them)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.loader import use_cuda_graphs
from engine.layers import attention
from engine.types.config import EngineConfig
from engine.worker.forward_batch import ForwardBatch
from engine.worker.graphs import Bucket, Buckets
from engine.worker.model_runner import ModelRunner
from tests.engine.lossless import (
    MAX_NEW,
    Reference,
    assert_same_as_target,
    assert_same_sample_unless_near_tie,
    prompts_for,
)

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
BLOCK = 4
SMALL = Buckets(batch=(1, 2, 4), query=(1, 2, 4), context=(8, 16, 32, 64))


def test_buckets_cover_every_short_forward_up_to_the_limits():
    b = Buckets.for_limits(max_num_seqs=64, k_max=8, max_model_len=2048, block_size=16)
    assert b.batch == (1, 2, 4, 8, 16, 32, 48, 64)
    assert b.query == (1, 2, 4, 8, 9)
    assert b.context == (256, 512, 1024, 2048, 2064)  # the last: 2048 + 8 drafts + 1, in whole blocks
    assert b.pick(3, 5, 300) == Bucket(4, 8, 512)
    assert b.pick(64, 9, 2064) == Bucket(64, 9, 2064)
    assert b.pick(65, 1, 10) is None and b.pick(1, 10, 10) is None and b.pick(1, 1, 2065) is None
    long = Buckets.for_limits(max_num_seqs=64, k_max=8, max_model_len=131072, block_size=16)
    assert long.context == (256, 512, 1024, 2048, 4096)  # longer contexts run eagerly
    assert long.pick(1, 1, 4097) is None
    small = Buckets.for_limits(max_num_seqs=5, k_max=0, max_model_len=100, block_size=16, min_context=16)
    assert (small.batch, small.query, small.context) == ((1, 2, 4, 5), (1,), (16, 32, 64, 112))


def test_cuda_graphs_default_on_only_for_a_model_on_one_gpu(model_sets):
    runner = ModelRunner.load(str(model_sets["llama"].target), "float32", "cpu")
    assert use_cuda_graphs(EngineConfig(model="m"), runner) is False
    assert use_cuda_graphs(EngineConfig(model="m", cuda_graphs=True), runner) is True
    if torch.cuda.is_available():
        gpu = ModelRunner.load(str(model_sets["llama"].target), "float32", "cuda")
        assert use_cuda_graphs(EngineConfig(model="m"), gpu) is True
        assert use_cuda_graphs(EngineConfig(model="m", cuda_graphs=False), gpu) is False


def _pair(path, device: str, paged_kernel: bool = False) -> tuple[ModelRunner, ModelRunner]:
    """Two runners of the same weights: one eager, one in ``SMALL``'s buckets."""
    eager, static = ModelRunner.load(str(path), "float32", device), ModelRunner.load(str(path), "float32", device)
    for r in (eager, static):
        r.allocate_cache(num_blocks=48, block_size=BLOCK)
    static.use_buckets(SMALL, paged_kernel)
    return eager, static


@pytest.fixture
def flex_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts attention layers that ran through FlexAttention, so a silent fall-back to the gather fails."""
    calls: list[int] = []
    inner = attention._paged_flex

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(attention, "_paged_flex", counted)
    return calls


def _same_caches(a: ModelRunner, b: ModelRunner) -> None:
    """Every slot but the scratch one holds the same K/V: padding wrote nowhere else."""
    assert a.cache is not None and b.cache is not None
    n = a.cache.scratch_slot
    for ka, kb, va, vb in zip(a.cache.k, b.cache.k, a.cache.v, b.cache.v):
        torch.testing.assert_close(ka[:n], kb[:n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(va[:n], vb[:n], rtol=1e-5, atol=1e-5)


KERNELS = [("llama", "gather"), ("mistral", "gather"), ("gpt2", "gather"), ("llama", "flex"), ("mistral", "flex")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("arch", "kernel"), KERNELS, ids=[f"{a}-{k}" for a, k in KERNELS])
def test_padding_changes_no_logit_and_writes_only_real_slots(arch, kernel, device, model_sets, flex_calls):
    """Three sequences (scattered blocks; mistral's 24-token window shorter than their contexts; gpt2's
    learned positions) prefilled eagerly, then short steps padded in batch, query and context, one
    per context bucket, and one larger than every bucket (eager, same output). "flex": attention
    reads the cache in place through the block tables (the sliding window as FlexAttention's score_mod)."""
    eager, static = _pair(model_sets[arch].target, device, paged_kernel=kernel == "flex")
    g = torch.Generator().manual_seed(1)
    lengths = [30, 9, 14]
    seqs = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]
    tables = [list(range(15, 5, -1)), list(range(20, 30)), list(range(40, 30, -1))]
    done = [n - 5 for n in lengths]
    for r in (eager, static):  # prefill: long queries, the eager path on both
        r.forward(ForwardBatch([s[:d] for s, d in zip(seqs, done)], [0, 0, 0], tables, [0, 0, 0]))
    assert static.static is not None and static.static.replays == 0
    steps = [[1, 2, 1], [2, 1, 0], [1, 0, 1]]  # tokens per sequence per step; 0 = not in this step
    for feed in steps:
        idx = [i for i, n in enumerate(feed) if n]
        batch = ForwardBatch([seqs[i][done[i] : done[i] + feed[i]] for i in idx], [done[i] for i in idx],
                             [tables[i] for i in idx], [feed[i] for i in idx])
        before = static.static.replays
        want, got = eager.forward(batch), static.forward(batch)
        assert static.static.replays == before + 1, "the step did not run in a bucket"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for i in idx:
            done[i] += feed[i]
    _same_caches(eager, static)
    assert bool(flex_calls) == (kernel == "flex")
    # Five sequences: more than the largest batch bucket (4), so the eager path, with the same logits.
    extra = [torch.randint(3, 300, (5,), generator=g).tolist() for _ in range(2)]
    batch = ForwardBatch([[s[d]] for s, d in zip(seqs, done)] + extra, [*done, 0, 0],
                         [*tables, [1, 2], [3, 4]], [1] * 5)
    before = static.static.replays
    torch.testing.assert_close(static.forward(batch), eager.forward(batch), rtol=1e-4, atol=1e-4)
    assert static.static.replays == before
    _same_caches(eager, static)


@pytest.mark.parametrize("device", DEVICES)
def test_tokens_already_on_the_device_feed_the_bucket_like_host_tokens(device, model_sets):
    """The draft loop passes its last tokens as a device tensor; the bucket scatters them to their rows."""
    eager, static = _pair(model_sets["llama"].target, device)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
    tables = [[3, 4, 5], [7]]
    for r in (eager, static):
        r.forward(ForwardBatch(prompts, [0, 0], tables, [0, 0]))
    nxt = [[12, 13], [43]]
    ids = torch.tensor([12, 13, 43], device=static.device)
    batch = ForwardBatch([[0, 0], [0]], [7, 3], tables, [2, 1], input_ids=ids)  # host ids are placeholders
    want = eager.forward(ForwardBatch(nxt, [7, 3], tables, [2, 1]))
    torch.testing.assert_close(static.forward(batch), want, rtol=1e-4, atol=1e-4)
    if device == "cuda":
        assert static.static is not None and static.static.graphs, "CUDA forwards ran without a captured graph"


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
CASES = [("llama", "draft_model", 4), ("mistral", "hybrid", None), ("gpt2", "ngram", 4), ("gemma", "none", None),
         ("qwen3", "draft_model", None), ("qwen2", "self", 4), ("llama", "self", None), ("gpt2", "self+exit", 4)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("arch", "method", "k"), CASES, ids=[f"{a}-{m}-k{k}" for a, m, k in CASES])
def test_greedy_output_in_buckets_equals_the_target_alone(arch, method, k, device, model_sets, exit_targets,
                                                          tokenizer_dir):
    """"self+exit": the early exit through a trained exit head (engine.models.exit_head)."""
    ms = model_sets[arch]
    llm = LLM(model=str(exit_targets[arch] if method == "self+exit" else ms.target),
              draft_model=str(ms.draft) if method in ("draft_model", "hybrid") else None,
              draft_layers=1 if method.startswith("self") else None, speculative_method=method.split("+")[0],
              num_speculative_tokens=k,
              dtype="float32", device=device, block_size=BLOCK, max_num_seqs=8, cuda_graphs=True)
    ref = Reference(ms.target)
    prompts = prompts_for(tokenizer_dir)
    for batch in ([prompts[0]], prompts):
        for prompt, out in zip(batch, llm.generate(batch, GREEDY)):
            assert_same_as_target(ref, prompt, out.token_ids, f"{arch}/{method}/k={k} on {device}")
    engine = llm.engine
    assert engine.target.static is not None and engine.target.static.replays > 0
    runners = [engine.target] + ([d.runner for d in engine.drafting.drafters] if engine.drafting is not None else [])
    for runner in runners:
        assert runner.static is not None and runner.static.replays > 0, f"{runner.name} never ran in a bucket"
        if device == "cuda":
            assert runner.static.graphs, f"{runner.name}: no CUDA graph captured"


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_output_with_flex_attention_equals_the_target_alone(device, model_sets, tokenizer_dir, flex_calls):
    """The paged kernel in the engine: the draft loop and verify steps at batch 1 and 4 (two batch buckets,
    each its own compiled shape) read the cache through the block tables, and greedy output is the target's."""
    ms = model_sets["llama"]
    llm = LLM(model=str(ms.target), draft_model=str(ms.draft), speculative_method="draft_model",
              num_speculative_tokens=4, dtype="float32", device=device, block_size=BLOCK, max_num_seqs=4,
              cuda_graphs=True, paged_attention="flex")
    ref = Reference(ms.target)
    prompts = prompts_for(tokenizer_dir)[:4]
    for batch in ([prompts[0]], prompts):
        for prompt, out in zip(batch, llm.generate(batch, GREEDY)):
            assert_same_as_target(ref, prompt, out.token_ids, f"flex attention on {device}")
    assert flex_calls and llm.engine.target.static is not None and llm.engine.target.static.paged_kernel


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_samples_are_the_same_with_and_without_buckets(device, model_sets, tokenizer_dir):
    ms = model_sets["llama"]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7)
    prompts = prompts_for(tokenizer_dir)[:4]
    outs = {}
    for graphs in (False, True):
        llm = LLM(model=str(ms.target), draft_model=str(ms.draft), speculative_method="hybrid", dtype="float32",
                  device=device, block_size=BLOCK, max_num_seqs=8, cuda_graphs=graphs)
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
    ref = Reference(ms.target)
    for prompt, got, want in zip(prompts, outs[True], outs[False]):
        assert_same_sample_unless_near_tie(ref, prompt, got, want, 7, 0.9, 0.95, f"seeded, buckets on {device}")


def test_a_block_table_longer_than_the_largest_bucket_still_runs_in_a_bucket(model_sets):
    """Blocks past the largest context bucket (16 here) hold nothing a bucketed forward reads."""
    eager, static = _pair(model_sets["llama"].target, "cpu")
    table = list(range(20))
    for r in (eager, static):
        r.forward(ForwardBatch([[5, 6, 7, 8, 9, 10]], [0], [table], [0]))
    batch = ForwardBatch([[11]], [6], [table], [1])
    torch.testing.assert_close(static.forward(batch), eager.forward(batch), rtol=1e-4, atol=1e-4)
    assert static.static is not None and static.static.replays == 1

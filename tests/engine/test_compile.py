"""torch.compile of the decode and verify forwards (LLM(compile=True), --compile): still lossless, long
prefill chunks stay eager, and a compiled forward that fails falls back to eager with the same output."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_runner import ForwardBatch
from tests.engine.lossless import MAX_NEW, Reference, assert_same_as_target, prompts_for
from tests.engine.test_lossless_sampling import chi_square_p, engine_samples, exact_joint

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def compiled_llm(model_sets) -> LLM:
    ms = model_sets["llama"]
    return LLM(model=str(ms.target), draft_model=str(ms.draft), speculative_method="draft_model",
               num_speculative_tokens=4, dtype="float32", device="cpu", compile=True)


def runners(llm: LLM):
    return [llm.engine.target, *(d.runner for d in llm.engine.drafting.drafters)]


def test_compiled_speculation_is_lossless_and_really_compiled(compiled_llm, model_sets, tokenizer_dir):
    ref = Reference(model_sets["llama"].target)
    before = [r.compiled.calls for r in runners(compiled_llm)]
    prompts = prompts_for(tokenizer_dir)
    for p, out in zip(prompts, compiled_llm.generate(prompts, GREEDY)):
        assert_same_as_target(ref, p, out.token_ids, "compiled target and draft")
    for runner, b in zip(runners(compiled_llm), before):
        assert runner.compiled.calls > b and not runner.compiled.failed, f"{runner.name} never ran compiled"


def test_a_layout_the_warm_up_did_not_compile_runs_eagerly_instead_of_stalling_to_compile(compiled_llm):
    """Three sequences feeding 2, 1 and 3 tokens, one logits row each: not among the warm-up's layouts.
    Compiled while serving, it would hold its step for a compile; it runs eagerly, with the same logits."""
    from torch._dynamo.utils import counters

    runner = compiled_llm.engine.target
    assert runner.compiled.frozen
    batch = ForwardBatch([[7, 8], [9], [10, 11, 12]], [20, 30, 10], [[1, 2], [3, 4, 5], [6]], [1, 1, 3])
    frames = counters["frames"]["ok"]
    got = runner.forward(batch)
    assert counters["frames"]["ok"] == frames, "a layout was compiled while serving"
    runner.compiled.failed = True  # the same forward through the plain model
    try:
        want = runner.forward(batch)
    finally:
        runner.compiled.failed = False
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_long_prefill_chunk_runs_eagerly_with_the_same_logits(compiled_llm, model_sets):
    runner = compiled_llm.engine.target
    calls = runner.compiled.calls
    tokens = list(range(5, 45))  # 40 tokens: longer than the short-query layouts
    got = runner.forward(ForwardBatch([tokens], [0], [list(range(3))], [len(tokens)]))
    assert runner.compiled.calls == calls
    ref = Reference(model_sets["llama"].target)
    with torch.no_grad():
        want = ref.model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_failing_compiled_forward_falls_back_to_eager_with_the_same_output(model_sets, tokenizer_dir, caplog):
    ms = model_sets["llama"]
    llm = LLM(model=str(ms.target), speculative_method="none", dtype="float32", device="cpu", compile=True)
    compiled = llm.engine.target.compiled

    def broken(**inputs):  # noqa: ANN003, ANN202
        raise RuntimeError("an inductor failure")

    compiled._compiled = broken
    prompts = prompts_for(tokenizer_dir)[:3]
    outs = llm.generate(prompts, GREEDY)
    assert compiled.failed and "running it eagerly" in caplog.text
    ref = Reference(ms.target)
    for p, out in zip(prompts, outs):
        assert_same_as_target(ref, p, out.token_ids, "after the fallback")


def test_compiled_sampling_follows_the_target_distribution(tmp_path_factory):
    from tests.engine.test_lossless_sampling import _peaky_model

    root = tmp_path_factory.mktemp("vocab8c")
    _peaky_model(root / "target", seed=11)
    _peaky_model(root / "draft", seed=12)
    llm = LLM(model=str(root / "target"), draft_model=str(root / "draft"), speculative_method="draft_model",
              num_speculative_tokens=3, dtype="float32", device="cpu", max_num_seqs=512,
              max_num_batched_tokens=4096, seed=1234, compile=True)
    counts = engine_samples(llm, temperature=1.0)
    assert all(r.compiled.calls > 0 and not r.compiled.failed for r in runners(llm))
    assert chi_square_p(counts, exact_joint(root / "target", temperature=1.0)) > 1e-3

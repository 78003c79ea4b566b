"""torch.compile of the decode and verify forwards (LLM(compile=...), --compile): compiled in the background while
serving eagerly, then switched; still lossless; long prefill chunks stay eager; and a compiled forward that
fails falls back to eager with the same output."""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import pytest
import torch

from engine import LLM, CompileMode, EngineConfig, SamplingParams
from engine.layers import attention, small_linear
from engine.layers.attention_metadata import SHORT_QUERY
from engine.speculative import calibrate as calibration
from engine.speculative.calibrate import profile_blocks
from engine.worker import aot_graphs, precompile
from engine.worker.compiled import BackgroundWarmUp
from engine.worker.forward_batch import ForwardBatch
from engine.worker.model_runner import ModelRunner
from engine.worker.warm_up_layouts import warm_up_layouts
from tests.engine.core.test_lossless_sampling import chi_square_p, engine_samples, exact_joint
from tests.engine.lossless import MAX_NEW, Reference, assert_same_as_target

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
# Prompts over the 8-token vocabulary of the sampling tests' peaky pair.
PROMPTS = [[1, 2, 3, 1, 2], [7, 0, 4], [5, 5, 6, 1, 0, 2, 3], [4]]
K = 3


@pytest.fixture(scope="module")
def pair8(tmp_path_factory) -> Path:
    from tests.engine.core.test_lossless_sampling import _peaky_model

    root = tmp_path_factory.mktemp("vocab8c")
    # One layer each, one config, other weights: a cold compile's time is per layer and per layout, and the
    # draft's layouts then generate the target's C++, which inductor's cache compiles once (the weights are
    # inputs). The draft must still run its own graphs: same shapes make a mix-up a wrong token, not an error.
    _peaky_model(root / "target", seed=11, layers=1)
    _peaky_model(root / "draft", seed=12, layers=1)
    return root


@pytest.fixture(scope="module")
def held_llm(pair8) -> LLM:
    """One compiled engine for every test here: a cold inductor compile of a target and a draft costs ~9 minutes on
    CI's 2 cores (a fresh checkout misses the compile cache), so every check shares it. Compiled in the
    background (the server's default on CPU), its thread held until the first test starts it by hand."""
    # A first start: no graph files for this pair (an earlier run's would be loaded before serving, at_start).
    config = EngineConfig(model=str(pair8 / "target"), draft_model=str(pair8 / "draft"),
                          speculative_method="draft_model", num_speculative_tokens=K)
    for model in ("target", "draft"):
        runner = types.SimpleNamespace(name=str(pair8 / model), dtype=torch.float32,
                                       cache=types.SimpleNamespace(block_size=config.block_size))
        precompile.artifact(runner, config.k_max).unlink(missing_ok=True)
    start = BackgroundWarmUp.start
    BackgroundWarmUp.start = lambda self: self  # type: ignore[method-assign]
    try:
        return LLM(model=str(pair8 / "target"), draft_model=str(pair8 / "draft"), speculative_method="draft_model",
                   num_speculative_tokens=K, dtype="float32", device="cpu", max_num_seqs=512,
                   max_num_batched_tokens=4096, seed=1234, compile="background",
                   compile_prompts=False)  # the prompt graphs after: minutes more (test_prompt_layouts.py)
    finally:
        BackgroundWarmUp.start = start  # type: ignore[method-assign]


@pytest.fixture
def compiled_llm(held_llm) -> LLM:
    """The module's engine with its background compile done (started here when a test runs on its own)."""
    background = held_llm.engine.background_compile
    assert background is not None
    if background.thread.ident is None:
        background.thread.start()
    assert background.join(timeout=1800)
    return held_llm


def runners(llm: LLM) -> list[ModelRunner]:
    return [llm.engine.target, *(d.runner for d in llm.engine.drafting.drafters)]


# A cold compile of the pair while requests are served: 555 s in the suite on a 2-core AVX2 machine (680 s with a
# two-layer target, 900 s with a two-layer draft compiled over every layout too),
# where the child gets only what the suite's other worker leaves (tests/conftest.py runs this module first)
@pytest.mark.timeout(1800)
def test_requests_are_served_eagerly_before_the_background_compile_and_compiled_after_it(held_llm, pair8):
    llm = held_llm
    engine, ref = llm.engine, Reference(pair8 / "target", eos=7)
    background = engine.background_compile
    assert background is not None and background.thread.ident is None, "run this test first: it starts the compile"
    assert engine.compile_mode is CompileMode.BACKGROUND and engine.compile_state == "compiling"
    # the warm-up's own blocks: past the block manager's, in both caches
    extra = ModelRunner.warm_up_blocks(K, engine.config.block_size)
    assert all(r.cache.num_blocks == engine.block_manager.num_blocks + extra for r in runners(llm))

    for p, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        assert_same_as_target(ref, p, out.token_ids, "before the compile")
    assert all(r.compiled.calls == 0 and r.compiled.warming_in is not None for r in runners(llm)), "not eager"

    # While it compiles: requests keep being served, the target's output throughout.
    background.thread.start()
    served = 0
    while background.thread.is_alive() or served == 0:
        for p, out in zip(PROMPTS[:2], llm.generate(PROMPTS[:2], GREEDY)):
            assert_same_as_target(ref, p, out.token_ids, "during the compile")
        served += 1
        time.sleep(10.0)  # room for the compile: its child takes only the CPU requests (and the suite) leave
    assert background.join(timeout=0)
    assert background.seconds is not None and engine.compile_state == "compiled"
    assert all(r.compiled.precompiled is not None for r in runners(llm)), "compiled in a child process, loaded here"
    # The draft model's file leaves out the layouts that return several rows of one sequence: it never runs them.
    target, draft = runners(llm)
    layouts = warm_up_layouts(K, engine.config.block_size, target.cache.num_blocks)
    assert len(target.compiled.precompiled) == len(layouts)
    assert len(draft.compiled.precompiled) == sum(max(b.logits_rows) == 1 for b in layouts) < len(layouts)

    before = [r.compiled.calls for r in runners(llm)]
    for p, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        assert_same_as_target(ref, p, out.token_ids, "after the compile")
    for runner, calls in zip(runners(llm), before):
        assert runner.compiled.frozen and runner.compiled.warming_in is None
        assert runner.compiled.calls > calls, f"{runner.name} never ran compiled"
        assert runner.compiled.uncompiled == 0, f"{runner.name} met a layout its warm-up did not compile"


def test_a_later_start_finds_the_graphs_on_disk_and_serves_compiled_from_its_first_request(compiled_llm, pair8,
                                                                                           tmp_path):
    """The files the background compile wrote: a server started afterwards (its own process, like a restart)
    loads them before it answers, and /health says compiled at once; its outputs stay the target's. Adaptive k
    (the same k_max, so the same files): the goodput controller's start-up profile runs the models too, and every
    forward it times fits a graph (the draft's, timed on verify-shaped layouts, had run eagerly)."""
    from openai import OpenAI

    from tests.server.test_cli import Process

    args = ["--model", str(pair8 / "target"), "--draft-model", str(pair8 / "draft"), "--speculative-method",
            "draft_model", "--max-speculative-tokens", str(K), "--dtype", "float32", "--device", "cpu",
            "--compile", "background", "--no-compile-prompts"]
    server = Process(tmp_path, args, OMP_NUM_THREADS=str(torch.get_num_threads()))  # the files' thread count
    try:
        server.wait_ready()
        assert httpx.get(server.url + "/health").json() == {"status": "ready", "compile": "compiled"}
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        ref = Reference(pair8 / "target", eos=7)
        # PROMPTS[3] is one token: a context of one is a size dynamo specializes (0/1), a graph of its own.
        for p in PROMPTS:
            out = client.completions.create(model=model, prompt=p, max_tokens=MAX_NEW, temperature=0.0,
                                            extra_body={"return_token_ids": True})
            assert_same_as_target(ref, p, out.choices[0].model_extra["token_ids"], "compiled from the start")
    finally:
        server.proc.terminate()
        server.wait_exit()
    log = server.log.read_text()
    assert "serve compiled from the start" in log and "precompiled graphs in" in log, log
    assert "compiling" not in log and "run eagerly" not in log, log


def test_compile_start_serves_the_graphs_on_disk_before_it_returns(compiled_llm, pair8, caplog, monkeypatch):
    """--compile start on CPU serves the graphs the background compile wrote, loaded before the engine exists, not
    this process's own torch.compile (dynamic shapes: slower forwards, and compiled again at every start); it has
    the prompt graphs compiled first, which a background compile leaves until its decode graphs serve (their
    compile: tests/engine/worker/test_prompt_layouts.py; here it is only asked for, minutes on 2 cores)."""
    caplog.set_level(logging.INFO, logger="engine")
    asked: list[tuple[list[str], int]] = []
    monkeypatch.setattr(precompile, "compile_prompts", lambda runners, k_max, *args: asked.append(
        ([r.name for r in runners], k_max)))
    llm = LLM(model=str(pair8 / "target"), draft_model=str(pair8 / "draft"), speculative_method="draft_model",
              num_speculative_tokens=K, dtype="float32", device="cpu", compile="start")
    engine = llm.engine
    assert engine.compile_mode is CompileMode.START and engine.background_compile is None
    assert engine.compile_state == "compiled" and "serve graphs compiled ahead of time" in caplog.text
    assert all(r.compiled.precompiled is not None and r.compiled.frozen for r in runners(llm))
    assert "compiling /" not in caplog.text, "compiled in this process"
    assert asked == [([r.name for r in runners(llm)], K)], "the prompt graphs were not asked for"
    ref = Reference(pair8 / "target", eos=7)
    for p, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        assert_same_as_target(ref, p, out.token_ids, "--compile start")
    for runner in runners(llm):
        assert runner.compiled.calls > 0 and runner.compiled.uncompiled == 0, runner.name


def failing_child(*args, **kwargs) -> subprocess.Popen[bytes]:  # noqa: ANN002, ANN003
    return subprocess.Popen([sys.executable, "-c", "raise SystemExit('no compiler here')"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_a_failed_background_warm_up_leaves_the_model_eager_and_serving(pair8, monkeypatch, caplog):
    """The child fails, then the compile in this process too."""
    def broken(self, k_max, first_block=0):  # noqa: ANN001, ANN202
        raise RuntimeError("an inductor failure")

    monkeypatch.setattr(precompile, "spawn", failing_child)
    monkeypatch.setattr(ModelRunner, "warm_up_compiled", broken)
    llm = LLM(model=str(pair8 / "target"), speculative_method="none", dtype="float32", device="cpu",
              compile="background", compile_prompts=False)
    assert llm.engine.background_compile is not None and llm.engine.background_compile.join(timeout=60)
    assert llm.engine.compile_state == "failed" and "they run eagerly" in caplog.text
    assert "no compiler here" in caplog.text and "compiling here instead" in caplog.text
    ref = Reference(pair8 / "target", eos=7)
    for p, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        assert_same_as_target(ref, p, out.token_ids, "after a failed compile")


def test_compiled_speculation_is_lossless_and_really_compiled(compiled_llm, pair8):
    ref = Reference(pair8 / "target", eos=7)
    before = [(r.compiled.calls, r.compiled.uncompiled) for r in runners(compiled_llm)]
    for p, out in zip(PROMPTS, compiled_llm.generate(PROMPTS, GREEDY)):
        assert_same_as_target(ref, p, out.token_ids, "compiled target and draft")
    for runner, (calls, uncompiled) in zip(runners(compiled_llm), before):
        assert runner.compiled.calls > calls and not runner.compiled.failed, f"{runner.name} never ran compiled"
        assert runner.compiled.uncompiled == uncompiled, f"{runner.name} met a layout its warm-up did not compile"


def _decode_step(llm: LLM, runner: ModelRunner) -> tuple[int, int]:
    """One decode forward of a layout the warm-up compiled, in the warm-up's own blocks (no sequence's cache):
    how many forwards then ran compiled, and how many eagerly in a layout with no graph that fit."""
    runner.forward(ForwardBatch([[7]], [5], [[llm.engine.block_manager.num_blocks]], [1]))
    return runner.compiled.calls, runner.compiled.uncompiled


def test_a_precompiled_forward_checks_each_graphs_guards_once(compiled_llm, monkeypatch):
    """The graph that runs had its guards checked to be picked; torch's call of it checked them all again, every
    forward (batch-1 agentic turns ran 1.11x faster without)."""
    runner = compiled_llm.engine.target
    checked: list[int] = []
    for graphs in runner.compiled.precompiled.graphs.values():
        for fn in graphs:
            def check(*args, _fn=fn, _check=fn.guard_check, **kwargs):  # noqa: ANN002, ANN003, ANN202
                checked.append(id(_fn))
                return _check(*args, **kwargs)

            monkeypatch.setattr(fn, "guard_check", check)
    calls = runner.compiled.calls
    assert _decode_step(compiled_llm, runner)[0] == calls + 1, "ran a precompiled graph"
    assert checked and len(checked) == len(set(checked)), "a graph's guards checked twice in one forward"


def test_a_loaded_graphs_own_guard_check_answers_as_torchs_for_every_forward(compiled_llm, monkeypatch):
    """Each graph read back checks its guards on the inputs as they come, without torch's binding them to the
    entry's signature (engine.worker.model_guards.check_directly): on every forward of prompts, decodes, verifies
    and catch-ups, both models, each candidate graph answers as torch's own check does."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    from engine.layers.tracing import compiled_call

    answers: list[bool] = []
    serve = precompile.Precompiled.__call__

    def compared(self, **inputs):  # noqa: ANN001, ANN003, ANN202
        keep = getattr(self.rows, "keep", None)
        shape = (aot_graphs.structure(inputs[attention.METADATA_KWARG]), keep is not None)
        with compiled_call():
            for fn in self.graphs.get(shape, ()):
                ours = fn.guard_check(self.entry, **inputs)
                assert ours == AOTCompiledFunction.guard_check(fn, self.entry, **inputs)
                answers.append(ours)
        return serve(self, **inputs)

    for runner in runners(compiled_llm):
        graphs = [fn for group in runner.compiled.precompiled.graphs.values() for fn in group]
        assert all("guard_check" in vars(fn) for fn in graphs), f"{runner.name}: torch's check left in place"
    monkeypatch.setattr(precompile.Precompiled, "__call__", compared)
    compiled_llm.generate(PROMPTS, GREEDY)
    assert True in answers and False in answers, answers


def test_loaded_graphs_call_their_kernels_directly_with_the_logits_of_torchs_call(compiled_llm, monkeypatch):
    """AOTAutograd's runtime wrapper only hands these graphs' calls through (engine.worker.kernel_call): every graph
    read back, both models', calls inductor's function itself, and a decode and a verify forward that way give the
    logits torch's own call gives, bit for bit."""
    direct: list[int] = []
    graphs = []  # (the bytecode's globals, the name its call looks up, our direct call)
    for runner in runners(compiled_llm):
        for group in runner.compiled.precompiled.graphs.values():
            for fn in group:
                scope, name = fn.fn.__globals__, fn._artifacts.backend_id
                assert hasattr(scope[name], "__wrapped__"), f"a graph of {runner.name} keeps torch's call"
                graphs.append((scope, name, scope[name]))
    for scope, name, kernel in graphs:
        def counted(*args, _kernel=kernel):  # noqa: ANN002, ANN202
            direct.append(1)
            return _kernel(*args)

        monkeypatch.setitem(scope, name, counted)
    runner = compiled_llm.engine.target
    block = [compiled_llm.engine.block_manager.num_blocks]  # the warm-up's own block: no sequence's cache
    for tokens in ([7], [7, 1, 2, 3][: K + 1]):
        batch = ForwardBatch([tokens], [5], [block], [len(tokens)])
        calls, ran = runner.compiled.calls, len(direct)
        ours = runner.forward(batch).clone()
        assert runner.compiled.calls == calls + 1 and len(direct) == ran + 1, "a graph ran, by its direct call"
        with monkeypatch.context() as torchs:
            for scope, name, kernel in graphs:
                torchs.setitem(scope, name, kernel.__wrapped__)
            theirs = runner.forward(batch)
        assert runner.compiled.calls == calls + 2 and len(direct) == ran + 1, "a graph ran, by torch's call"
        assert torch.equal(ours, theirs)


def test_a_precompiled_forward_checks_no_guard_on_the_model_it_was_loaded_for(compiled_llm, monkeypatch):
    """The model's ~90% of a graph's guards (its modules' attributes, parameters, types) were checked once when
    the graph was read back (engine.worker.model_guards): a forward passes though an attribute of the model that
    its graphs hold as a constant has changed since (its final norm's epsilon), which a check of every guard
    would fail (next test)."""
    runner = compiled_llm.engine.target
    norm = runner.model.model.norm
    calls, uncompiled = runner.compiled.calls, runner.compiled.uncompiled
    monkeypatch.setattr(norm, "variance_epsilon", 2 * norm.variance_epsilon)
    assert _decode_step(compiled_llm, runner) == (calls + 1, uncompiled), "its model's guards were checked"


def test_graphs_that_do_not_fit_the_model_at_load_keep_every_guard_and_never_run(compiled_llm, monkeypatch, caplog):
    """Read back while the model differs from the one traced (its final norm's epsilon, a constant in the graphs),
    each graph fails its model's guards at load: it keeps them all, fails them every forward, and the forward
    runs eagerly. Read back as traced, the same file's graphs run."""
    caplog.set_level(logging.INFO, logger="engine")
    runner = compiled_llm.engine.target
    norm, path = runner.model.model.norm, precompile.artifact(runner, compiled_llm.engine.config.k_max)
    eps = norm.variance_epsilon
    with monkeypatch.context() as changed:
        changed.setattr(norm, "variance_epsilon", 2 * eps)
        unfit = precompile.load(runner, path)
        assert unfit is not None and f"{len(unfit)} of {len(unfit)} precompiled graphs of" in caplog.text
        monkeypatch.setattr(runner.compiled, "precompiled", unfit)
        calls, uncompiled = runner.compiled.calls, runner.compiled.uncompiled
        assert _decode_step(compiled_llm, runner) == (calls, uncompiled + 1), "a graph ran on a model it does not fit"
    assert norm.variance_epsilon == eps
    caplog.clear()
    fit = precompile.load(runner, path)
    assert fit is not None and "do not fit" not in caplog.text
    monkeypatch.setattr(runner.compiled, "precompiled", fit)
    calls, uncompiled = runner.compiled.calls, runner.compiled.uncompiled
    assert _decode_step(compiled_llm, runner) == (calls + 1, uncompiled)


def test_short_prompts_alone_or_many_at_once_meet_no_uncompiled_layout(compiled_llm, pair8):
    """A prompt of up to SHORT_QUERY tokens is fed through the compiled path: one of SHORT_QUERY tokens alone (its LM
    head then takes one row), and more prompts of one length admitted together than the head's
    rows (it then takes them packed; then they decode at one context, unmasked) were missing from the warm-up and
    ran eagerly."""
    ref = Reference(pair8 / "target", eos=7)
    alone = [[(3 * i) % 7 for i in range(SHORT_QUERY)]]
    together = [[(i + j) % 7 for j in range(5)] for i in range(small_linear.SMALL_ROWS + 4)]
    before = [(r.compiled.calls, r.compiled.uncompiled) for r in runners(compiled_llm)]
    for prompts in (alone, together):
        for p, out in zip(prompts, compiled_llm.generate(prompts, GREEDY)):
            assert_same_as_target(ref, p, out.token_ids, "short prompts, compiled")
    for runner, (calls, uncompiled) in zip(runners(compiled_llm), before):
        assert runner.compiled.calls > calls, f"{runner.name} never ran compiled"
        assert runner.compiled.uncompiled == uncompiled, f"{runner.name} met a layout its warm-up did not compile"


def test_the_target_and_the_draft_keep_their_compiled_graphs_apart(compiled_llm):
    """Each model's graphs run its own model: a target forward never tries the draft's (the two share their
    architecture's forward), and each graph's guards read the model it was loaded with."""
    target, draft = runners(compiled_llm)
    assert target.compiled.entry.__code__ is not draft.compiled.entry.__code__
    for runner in (target, draft):
        graphs = runner.compiled.precompiled
        assert graphs is not None and len(graphs) >= 10, f"{runner.name}: too few graphs"
        assert graphs.entry.model is runner.model


def test_the_adaptive_calibration_times_compiled_forwards_once_they_serve(compiled_llm, pair8, caplog, monkeypatch):
    """The timings that seed adaptive k are of the forwards in use: eager ones at start-up while the background
    compile runs, then the layouts the warm-up compiled, re-timed in the compile's own blocks once they serve
    (blocks no sequence owns: the outputs stay the target's). Prompt lookup drafts here, so only the target
    compiles: a draft model's timed forwards are the target's same two layouts."""
    caplog.set_level(logging.INFO, logger="engine")
    # The module's engine wrote this target's graphs (the same k_max): this engine finds them in its background
    # job, as it would once its child had written them, and shares the packed layers of the same checkpoint
    # loaded before it. Found at start, they would serve from the first request, with nothing to re-time.
    monkeypatch.setattr(precompile, "at_start", lambda runners, k_max: False)
    llm = LLM(model=str(pair8 / "target"), speculative_method="ngram", max_speculative_tokens=K, dtype="float32",
              device="cpu", compile="background", compile_prompts=False)
    engine, target = llm.engine, llm.engine.target
    config = engine.config
    profile = profile_blocks(config.k_max, config.block_size, config.max_num_batched_tokens, config.max_num_seqs)
    reserved = target.cache.num_blocks - engine.block_manager.num_blocks
    assert reserved == max(ModelRunner.warm_up_blocks(config.k_max, config.block_size),
                           min(profile, engine.block_manager.num_blocks // 16))
    eager = engine.controller.cost.parameters()
    ref = Reference(pair8 / "target", eos=7)
    served = 0
    while engine.compile_state == "compiling" or not served:  # the re-profile must not touch their blocks
        for p, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
            assert_same_as_target(ref, p, out.token_ids, "while compiling and re-profiling")
        served += 1
        time.sleep(0.5)
    assert engine.background_compile.join(timeout=600)
    took_over = [r for r in caplog.records if "step cost model once the compiled forwards took over" in r.getMessage()]
    assert [r.threadName for r in took_over] == [threading.current_thread().name], "timed between steps, by the stepper"
    assert "the model is loaded twice in this process; its packed layers are shared" in caplog.text
    assert "compile process" not in caplog.text, "compiled again"
    runs = calibration._runs(config.k_max, config.block_size, config.max_num_batched_tokens, reserved,
                             config.max_num_seqs)
    assert target.compiled.calls >= calibration.PASSES * len(runs) and target.compiled.uncompiled == 0
    assert engine.controller.cost.parameters()["target_decode_1_tokens"] != eager["target_decode_1_tokens"]
    for p, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        assert_same_as_target(ref, p, out.token_ids, "after the re-profile")


def test_graphs_of_a_checkpoint_loaded_twice_run_on_its_shared_layers_and_never_on_other_weights(compiled_llm, pair8,
                                                                                                caplog):
    """A second copy of a checkpoint in one process takes the first one's packed layers, checked equal, and loads
    its graphs; a model whose weights differ under the same keys (checkpoints whose fingerprints collide) gets
    none: it is compiled here instead."""
    caplog.set_level(logging.INFO, logger="engine")
    held = compiled_llm.engine.target
    path = precompile.artifact(held, compiled_llm.engine.config.k_max)

    def second() -> ModelRunner:
        runner = ModelRunner.load(str(pair8 / "target"), "float32", "cpu", compile=True)
        runner.allocate_cache(3 * ModelRunner.warm_up_blocks(K, 16), 16)
        return runner

    def packed(runner: ModelRunner) -> list[torch.nn.Module]:
        return [m for m in runner.model.modules() if getattr(m, "packed_key", None) is not None]

    copy = second()
    graphs = precompile.load(copy, path)
    assert graphs is not None and "its packed layers are shared" in caplog.text
    assert packed(copy) and all(m.packed is h.packed for m, h in zip(packed(copy), packed(held), strict=True))
    copy.compiled.precompiled, copy.compiled.frozen = graphs, True
    ref = Reference(pair8 / "target", eos=7)
    with torch.no_grad():
        want = ref.model(torch.tensor([[7, 1, 2, 3, 4, 5]])).logits[0, -1]
    copy.forward(ForwardBatch([[7, 1, 2, 3, 4]], [0], [[0]], [1]))  # the prompt
    calls = copy.compiled.calls
    got = copy.forward(ForwardBatch([[5]], [5], [[0]], [1]))
    assert copy.compiled.calls == calls + 1, "the loaded graphs served"
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=1e-4)

    caplog.clear()
    other = second()
    layer = packed(other)[0]
    layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach() * 2, 32)
    before = [(m.packed, m.packed_key) for m in packed(other)]
    assert precompile.load(other, path) is None
    assert "holds their layers' keys with other weights; compiling here" in caplog.text
    assert all(m.packed is p and m.packed_key == k for m, (p, k) in zip(packed(other), before)), "refused, yet changed"


@pytest.mark.parametrize("mode", ["background", "start"])
def test_where_the_child_fails_this_process_compiles_the_layouts_itself(pair8, monkeypatch, caplog, mode):
    """The in-process warm-up (the fallback of a failed child, and a self-drafting model's path): in a thread
    while serving (background) or before the engine exists (start), then it serves its graphs, with the target's
    output. Two of the layouts, for time: a sequence decoding over blocks in order or gathered."""
    from engine.worker import model_runner

    caplog.set_level(logging.INFO, logger="engine")
    layouts = model_runner.warm_up_layouts
    monkeypatch.setattr(model_runner, "warm_up_layouts", lambda *args: layouts(*args)[:2])
    monkeypatch.setattr(precompile, "spawn", failing_child)
    monkeypatch.setattr(precompile, "at_start", lambda runners, k_max: False)  # the module's files, if written
    llm = LLM(model=str(pair8 / "target"), speculative_method="none", dtype="float32", device="cpu", compile=mode,
              compile_prompts=False)
    if mode == "background":
        assert llm.engine.background_compile is not None and llm.engine.background_compile.join(timeout=600)
    else:  # the prompt graphs' child failed too: the server starts, its prompt chunks eager
        assert llm.engine.background_compile is None and "prompt chunks run eagerly" in caplog.text
    assert llm.engine.compile_state == "compiled" and "compiling here instead" in caplog.text
    assert "compiling /" in caplog.text and "layout 2/2" in caplog.text, "compiled in this process"
    ref = Reference(pair8 / "target", eos=7)
    for p in PROMPTS:  # one at a time: a sequence decoding alone, the layouts compiled
        assert_same_as_target(ref, p, llm.generate([p], GREEDY)[0].token_ids, "compiled in this process")
    assert llm.engine.target.compiled.calls > 0, "never ran compiled"


def test_a_layout_the_warm_up_did_not_compile_runs_eagerly_instead_of_stalling_to_compile(compiled_llm):
    """Three sequences decoding one token each, over unequal contexts, the middle one wanting no logits: a row
    selection at one query per sequence, not among the warm-up's layouts. Compiled while serving, it would hold
    its step for a compile; it runs eagerly, with the same logits."""
    from torch._dynamo.utils import counters

    runner = compiled_llm.engine.target
    assert runner.compiled.frozen
    batch = ForwardBatch([[7], [1], [2]], [20, 30, 10], [[1, 2], [3, 4, 5], [6]], [1, 0, 1])
    frames, calls, uncompiled = counters["stats"]["unique_graphs"], runner.compiled.calls, runner.compiled.uncompiled
    eager = compiled_llm.engine.forward_counts.uncompiled
    got = runner.forward(batch)
    assert counters["stats"]["unique_graphs"] == frames, "a layout was compiled while serving"
    assert (runner.compiled.calls, runner.compiled.uncompiled) == (calls, uncompiled + 1), "counted as eager"
    assert compiled_llm.engine.forward_counts.uncompiled == eager + 1, "specd:uncompiled_forwards_total reads it"
    runner.compiled.failed = True  # the same forward through the plain model
    try:
        want = runner.forward(batch)
    finally:
        runner.compiled.failed = False
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_long_prefill_chunk_runs_eagerly_with_the_same_logits(compiled_llm, pair8):
    runner = compiled_llm.engine.target
    calls = runner.compiled.calls
    tokens = [i * 5 % 8 for i in range(40)]  # 40 tokens: longer than the short-query layouts
    got = runner.forward(ForwardBatch([tokens], [0], [list(range(3))], [len(tokens)]))
    assert runner.compiled.calls == calls
    ref = Reference(pair8 / "target", eos=7)
    with torch.no_grad():
        want = ref.model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_failing_compiled_forward_falls_back_to_eager_with_the_same_output(compiled_llm, pair8, caplog,
                                                                              monkeypatch):
    compiled = compiled_llm.engine.target.compiled

    def broken(**inputs):  # noqa: ANN003, ANN202
        raise RuntimeError("an inductor failure")

    # the module's engine, restored afterwards (another engine would cost a compile of its own)
    monkeypatch.setattr(compiled, "_compiled", broken)
    monkeypatch.setattr(compiled, "precompiled", broken)
    monkeypatch.setattr(compiled, "failed", False)
    outs = compiled_llm.generate(PROMPTS[:3], GREEDY)
    assert compiled.failed and "running it eagerly" in caplog.text
    ref = Reference(pair8 / "target", eos=7)
    for p, out in zip(PROMPTS[:3], outs):
        assert_same_as_target(ref, p, out.token_ids, "after the fallback")


def test_compiled_sampling_follows_the_target_distribution(compiled_llm, pair8):
    counts = engine_samples(compiled_llm, temperature=1.0)
    assert all(r.compiled.calls > 0 and not r.compiled.failed for r in runners(compiled_llm))
    assert chi_square_p(counts, exact_joint(pair8 / "target", temperature=1.0)) > 1e-3


def _scattered(rng: random.Random, G: int, Q: int, blocks: int) -> ForwardBatch:
    """G sequences with 20-40 tokens cached, feeding Q tokens each, their blocks scattered over the cache."""
    ends = [rng.randint(20, 40) for _ in range(G)]
    free = rng.sample(range(blocks), sum(-(-(e + Q) // 16) for e in ends))
    tables = []
    for e in ends:
        n = -(-(e + Q) // 16)
        tables.append(free[:n])
        free = free[n:]
    return ForwardBatch([[rng.randrange(50)] * Q for _ in ends], ends, tables, [Q] * G)


def test_a_model_whose_forward_breaks_the_graph_runs_eagerly_with_the_eager_logits(model_sets, caplog):
    """dynamo resumes a broken forward in frames of its own, and with the model's module guards dropped those reused
    one layout's graphs for another: logits 0.12-0.21 off at 4 sequences x 5 tokens after a 1 x 2 layout. One graph per
    layout or none: the model is served eagerly, exact, and the log says so."""
    runners = [ModelRunner.load(str(model_sets["llama"].target), "float32", "cpu", compile=c) for c in (True, False)]
    for r in runners:
        r.allocate_cache(num_blocks=96, block_size=16)
    runners[0].model.model.layers[0].register_forward_hook(lambda *_: torch._dynamo.graph_break())
    rng = random.Random(1)
    with torch.inference_mode():
        for G, Q in [(1, 2), (4, 5), (8, 1), (4, 5)]:
            batch = _scattered(rng, G, Q, 96)
            torch.testing.assert_close(runners[0].forward(batch), runners[1].forward(batch), atol=1e-5, rtol=1e-5)
    assert runners[0].compiled.failed and "running it eagerly" in caplog.text

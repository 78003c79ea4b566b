"""--compile background over HTTP: the server is ready at once, serving while its models compile, and /health
and specd:compile_state say where the compile stands (compiling, then compiled or failed); and
specd:uncompiled_forwards_total counts the forwards a compiled model ran eagerly, and the two prompt-forward
counters (compiled, eager) read the engine's counts."""

from __future__ import annotations

import threading
import time

from engine.worker import precompile
from engine.worker.compiled import BackgroundWarmUp
from engine.worker.model_runner import ModelRunner
from engine.worker.prompt_compile import PromptCompile
from tests.engine.worker.test_compile import failing_child
from tests.server.conftest import MODEL, tiny_engine


def state(live) -> dict[str, float]:
    return {s: live.metric("specd:compile_state", model_name=MODEL, state=s)
            for s in ("off", "compiling", "compiled", "failed")}


def test_a_background_compile_serves_at_once_and_reports_its_state(make_server, model_sets, monkeypatch):
    held: list[BackgroundWarmUp] = []
    monkeypatch.setattr(BackgroundWarmUp, "start", lambda self: held.append(self) or self)  # run below, by hand
    release = threading.Event()  # the prompt graphs' compile below, held until released (its thread binds _run)
    monkeypatch.setattr(PromptCompile, "_run", lambda self: release.wait(60))
    ms = model_sets["llama"]
    engine = tiny_engine(ms.target, compile="background")
    live = make_server(engine, compile="background")
    assert live.get("/health").json() == {"status": "ready", "compile": "compiling"}
    assert state(live) == {"off": 0.0, "compiling": 1.0, "compiled": 0.0, "failed": 0.0}
    client = live.client()
    eager = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=12, temperature=0.0)
    assert eager.usage.completion_tokens == 12

    # A warm-up that fails leaves the model eager and serving, and says so (a real compile: tests/engine).
    def broken(self, k_max, first_block=0):  # noqa: ANN001, ANN202
        raise RuntimeError("an inductor failure")

    monkeypatch.setattr(precompile, "spawn", failing_child)  # the child's compile fails, then this process's
    monkeypatch.setattr(ModelRunner, "warm_up_compiled", broken)
    # The prompt graphs' compile (engine.worker.prompt_compile) follows on the stepping thread; while it runs,
    # the compile is still under way.
    held[0].thread.start()
    assert held[0].join(timeout=30)
    prompts = engine.prompt_compile
    assert prompts is not None
    deadline = time.monotonic() + 30
    while prompts.thread.ident is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prompts.running and live.get("/health").json() == {"status": "ready", "compile": "compiling"}
    release.set()
    prompts.thread.join(timeout=30)
    assert live.get("/health").json() == {"status": "ready", "compile": "failed"}
    assert state(live) == {"off": 0.0, "compiling": 0.0, "compiled": 0.0, "failed": 1.0}
    again = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=12, temperature=0.0)
    assert again.choices[0].text == eager.choices[0].text

    # Forwards a compiled model ran eagerly (its layout not compiled: tests/engine/worker/test_compile.py), as
    # the engine counts them, at each scrape.
    assert live.metric("specd:uncompiled_forwards_total", model_name=MODEL) == 0.0
    engine.target.compiled.uncompiled = 3
    assert engine.forward_counts.uncompiled == 3
    assert live.metric("specd:uncompiled_forwards_total", model_name=MODEL) == 3.0
    engine.target.compiled.prompt_compiled, engine.target.compiled.prompt_eager = 5, 2
    assert live.metric("specd:compiled_prompt_forwards_total", model_name=MODEL) == 5.0
    assert live.metric("specd:eager_prompt_forwards_total", model_name=MODEL) == 2.0

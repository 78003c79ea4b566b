"""The worker-thread engine on its own: idle sleep, draining, the shutdown bound."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine import SamplingParams
from server.async_engine import AsyncEngine, EngineRequest, NotAcceptingError, QueueFullError
from tests.server.conftest import slow_steps, tiny_engine

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engine(model_sets):
    return tiny_engine(model_sets["llama"].target, max_num_seqs=2)


def request(rid: str, max_tokens: int) -> EngineRequest:
    return EngineRequest(rid, [5, 6, 7], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def test_idle_worker_sleeps_instead_of_stepping(engine, monkeypatch):
    steps = []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: steps.append(1) or step())

    async def scenario():
        ae = AsyncEngine(engine, max_queue=4)
        ae.start()
        await asyncio.sleep(0.2)
        assert steps == [], "no steps while there is nothing to do"
        outs = [o async for o in ae.submit([request("a", 5)]).outputs()]
        assert sum(len(o.new_token_ids) for o in outs) == 5 and outs[-1].finish_reason == "length"
        n = len(steps)
        await asyncio.sleep(0.2)
        assert len(steps) == n, "back to sleep once the request finished"
        await ae.shutdown(timeout=1)
        assert not ae._thread.is_alive()

    asyncio.run(scenario())


def test_shutdown_lets_in_flight_requests_finish_then_refuses_new_ones(engine, monkeypatch):
    slow_steps(monkeypatch, engine, 0.005)

    async def scenario():
        ae = AsyncEngine(engine, max_queue=4)
        ae.start()
        handle = ae.submit([request("a", 30), request("b", 20)])
        collected = asyncio.ensure_future(_collect(handle))
        await asyncio.sleep(0.02)
        await ae.shutdown(timeout=10)
        outs = await collected
        assert {o.request_id: o.finish_reason for o in outs if o.finished} == {"a": "length", "b": "length"}
        with pytest.raises(NotAcceptingError):
            ae.submit([request("c", 1)])

    asyncio.run(scenario())
    assert engine.block_manager.usage == 0


def test_shutdown_timeout_aborts_what_is_still_running(engine, monkeypatch):
    slow_steps(monkeypatch, engine, 0.02)  # 400 tokens would take seconds

    async def scenario():
        ae = AsyncEngine(engine, max_queue=4)
        ae.start()
        collected = asyncio.ensure_future(_collect(ae.submit([request("a", 400)])))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        await ae.shutdown(timeout=0.2)
        assert time.monotonic() - t0 < 5
        outs = await collected
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        assert 0 < sum(len(o.new_token_ids) for o in outs) < 400

    asyncio.run(scenario())
    assert not engine.has_unfinished() and engine.block_manager.usage == 0


def test_queue_limit_counts_requests_not_yet_running(engine, monkeypatch):
    slow_steps(monkeypatch, engine, 0.01)

    async def scenario():
        ae = AsyncEngine(engine, max_queue=2)
        ae.start()
        running = ae.submit([request("a", 300), request("b", 300)])  # max_num_seqs=2: both run
        # Their first output comes after the step that scheduled both, once the worker has refreshed its
        # waiting count (polling engine.num_running would race with that refresh).
        await asyncio.wait_for(running.outputs().__anext__(), 30)
        assert engine.num_running == 2
        waiting = ae.submit([request("c", 5), request("d", 5)])
        with pytest.raises(QueueFullError):
            ae.submit([request("e", 5)])
        running.close()  # frees both slots: c and d run and finish
        outs = [o async for o in waiting.outputs()]
        assert {o.request_id for o in outs if o.finished} == {"c", "d"}
        await ae.shutdown(timeout=1)

    asyncio.run(scenario())


async def _collect(handle) -> list:
    return [o async for o in handle.outputs()]


def test_a_job_handed_to_an_idle_engine_wakes_its_worker_and_runs_on_it_between_steps(engine):
    """The goodput controller's profile once the compiled forwards serve is such a job: handed over by the compile's
    thread, it must run on the worker, with no step beside it, even where no request comes to wake the worker."""
    ran: list[tuple[str, str]] = []

    async def scenario():
        ae = AsyncEngine(engine, max_queue=4)
        ae.start()
        await asyncio.sleep(0.1)
        threading.Thread(target=engine.between_steps.add,
                         args=(lambda: ran.append((threading.current_thread().name, engine.compile_state)),)).start()
        for _ in range(100):
            if ran:
                break
            await asyncio.sleep(0.02)
        assert ran == [("specd-engine", "compiling")], "run by the worker, reported as still compiling meanwhile"
        assert not engine.between_steps.pending and engine.compile_state == "off"
        outs = [o async for o in ae.submit([request("a", 3)]).outputs()]
        assert outs[-1].finish_reason == "length", "the engine serves on"
        await ae.shutdown(timeout=1)

    asyncio.run(scenario())

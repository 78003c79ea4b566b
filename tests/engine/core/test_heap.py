"""A process that holds one engine for its life keeps what the engine is built of out of garbage collection."""

from __future__ import annotations

import gc
import weakref

from engine import EngineConfig, LLMEngine
from engine.core import heap
from engine.worker.compiled import BackgroundWarmUp


class Node:
    pass


def test_an_engine_asked_to_freeze_the_heap_collects_the_garbage_then_leaves_the_rest_out_of_collections(model_sets):
    config = EngineConfig(model=str(model_sets["llama"].target), device="cpu", dtype="float32", num_kv_blocks=64)
    gc.unfreeze()
    gc.disable()  # only the engine's own collection may free the cycle below
    try:
        LLMEngine(config)
        assert gc.get_freeze_count() == 0, "the library's default freezes nothing"
        node = Node()
        node.self = node  # a cycle that nothing else refers to once ``node`` is gone: garbage, for the collector only
        ref = weakref.ref(node)
        del node
        LLMEngine(EngineConfig(**{**vars(config), "freeze_heap": True}))
        assert ref() is None, "the garbage is collected before the rest is frozen (frozen, it would never be)"
        assert gc.get_freeze_count() > 10_000, "the modules, weights and tokenizer the engine holds"
    finally:
        gc.enable()
        gc.unfreeze()


def test_the_heap_is_settled_again_on_the_stepping_thread_once_each_compile_adds_its_graphs(model_sets, monkeypatch):
    """The decode graphs a background compile loads and the prompt graphs compiled after them are objects the engine
    keeps for its life, made after the first settle: each compile, once done, has the stepping thread settle again."""
    settles: list[str] = []
    monkeypatch.setattr(heap, "settle", lambda: settles.append("settled"))
    monkeypatch.setattr(BackgroundWarmUp, "start", lambda self: self)  # its thread is never started: jobs run by hand
    engine = LLMEngine(EngineConfig(model=str(model_sets["llama"].target), device="cpu", dtype="float32",
                                    num_kv_blocks=64, compile="background", freeze_heap=True))
    assert settles == ["settled"] and not engine.between_steps.pending
    background, prompts = engine.background_compile, engine.prompt_compile
    assert background is not None and prompts is not None
    for job in prompts._then:  # as its thread runs them once prompt graphs were added
        job()
    assert settles == ["settled"] and engine.between_steps.pending, "on the stepping thread, not the compile's"
    engine.between_steps.run()
    assert settles == ["settled"] * 2
    monkeypatch.setattr(prompts, "start", lambda: settles.append("prompts started"))
    for job in background._then:  # the decode graphs loaded: the settle, then the prompt compile's start
        job()
    engine.between_steps.run()
    assert settles[2:] == ["settled", "prompts started"], "settled before the prompt compile takes the cores"

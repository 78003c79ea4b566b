"""A process that holds one engine for its life keeps what the engine is built of out of garbage collection."""

from __future__ import annotations

import gc
import weakref

from engine import EngineConfig, LLMEngine


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

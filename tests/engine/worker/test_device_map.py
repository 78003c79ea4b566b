"""A target split across devices by a device map (accelerate's path for a model too big for one GPU).

The CI machine has one device, so the map names "cpu" for every module explicitly: the split code
path runs (from_pretrained with the map, per-layer cache placement, logits returned on the input
device, the LM head's row selection), though no tensor crosses devices. The copy of the attention
layout to another device is pinned separately with the "meta" device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine import LLM, EngineConfig, SamplingParams
from engine.layers.kv_cache import LayerShape, PagedKVCache
from engine.types.config import parse_device_map
from engine.worker import loading
from engine.worker.layout import build_metadata
from engine.worker.staging import Uploader
from tests.engine.lossless import MAX_NEW, Reference, assert_same_as_target, prompts_for

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def explicit_cpu_map(target: Path) -> dict[str, str]:
    layers = AutoConfig.from_pretrained(target).num_hidden_layers
    return {
        "model.embed_tokens": "cpu",
        **{f"model.layers.{i}": "cpu" for i in range(layers)},
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }


@pytest.mark.parametrize("method", ["draft_model", "self", "none"])
def test_a_target_placed_by_an_explicit_device_map_decodes_like_the_unsplit_target(
    method, model_sets, tokenizer_dir, monkeypatch
):
    ms = model_sets["llama"]
    device_map = explicit_cpu_map(ms.target)
    maps_given = {}
    from_pretrained = AutoModelForCausalLM.from_pretrained

    def spy(path, **kwargs):
        maps_given[str(path)] = kwargs.get("device_map")
        return from_pretrained(path, **kwargs)

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", spy)
    llm = LLM(
        model=str(ms.target),
        draft_model=str(ms.draft) if method == "draft_model" else None,
        draft_layers=1 if method == "self" else None,
        speculative_method=method,
        num_speculative_tokens=None if method == "none" else 4,
        dtype="float32",
        device="cpu",
        device_map=device_map,
    )
    runner = llm.engine.target
    assert maps_given[str(ms.target)] == device_map, "the map reaches transformers' from_pretrained"
    if method == "draft_model":
        assert maps_given[str(ms.draft)] is None, "the draft is placed whole, on --device"
    assert runner.split and runner.device == torch.device("cpu")
    assert runner.layer_devices == [torch.device("cpu")] * len(runner.layer_shapes)
    assert runner.cache is not None and [k.device for k in runner.cache.k] == runner.layer_devices
    ref = Reference(ms.target)
    prompts = prompts_for(tokenizer_dir)
    for batch in ([prompts[0]], prompts):
        for prompt, out in zip(batch, llm.generate(batch, GREEDY)):
            assert_same_as_target(ref, prompt, out.token_ids, f"device_map/{method} batch={len(batch)}")
    if method != "none":
        assert llm.stats().num_draft_tokens > 0, "speculation never ran, so this test proved nothing"


def test_the_attention_layout_is_copied_once_per_other_device_and_keeps_its_shape():
    cache = PagedKVCache([LayerShape(2, 8, 8)] * 2, num_blocks=12, block_size=4, dtype=torch.float32,
                         device=torch.device("cpu"))
    # Sequence 0 decodes one token (the short group), sequence 1 prefills 40 (a long sequence).
    meta = build_metadata(cache, [[3, 4], list(range(11))], [5, 0], [6, 40], Uploader(torch.device("cpu")))
    assert meta.short is not None and len(meta.long) == 1
    assert meta.on(torch.device("cpu")) is meta

    moved = meta.on(torch.device("meta"))
    assert meta.on(torch.device("meta")) is moved, "one copy per device per forward"
    assert moved.cache is cache, "the cache stays where each layer put it"
    assert moved.short is not None
    tensors = [moved.slot_mapping, moved.positions, moved.short.rows, moved.short.real, moved.short.positions,
               moved.short.slots, moved.long[0].rows, moved.long[0].slots, moved.long[0].positions, moved.long[0].mask]
    assert meta.short.span == (12, 6), "one sequence in consecutive slots: a view"
    assert meta.short.slots is not None and meta.short.slots.tolist() == [list(range(12, 18))], "and, on the CPU, " \
        "the span's slots for the attention kernel"
    assert all(t.device.type == "meta" for t in tensors)
    assert moved.short.mask is None and meta.short.mask is None  # one query over one context: no mask either way
    assert moved.short.span == meta.short.span
    assert moved.long[0].rows.shape == meta.long[0].rows.shape and moved.long[0].fresh == meta.long[0].fresh
    assert meta.slot_mapping.device.type == "cpu", "the original is untouched"


def test_a_cache_for_a_split_model_puts_each_layer_on_its_own_device():
    devices = [torch.device("cpu"), torch.device("meta")]
    cache = PagedKVCache([LayerShape(2, 8, 8), LayerShape(1, 4, 4)], 3, 4, torch.float32, devices)
    assert [k.device.type for k in cache.k] == [v.device.type for v in cache.v] == ["cpu", "meta"]
    assert cache.k[1].shape == (13, 1, 4)  # 3 blocks of 4, and the scratch slot
    with pytest.raises(ValueError, match="1 devices for 2 layers"):
        PagedKVCache([LayerShape(2, 8, 8)] * 2, 3, 4, torch.float32, devices[:1])


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ("auto", "auto"),
        ("balanced_low_0", "balanced_low_0"),
        ('{"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cuda:1", "lm_head": 1}',
         {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cuda:1", "lm_head": 1}),
        ({"model": "cpu", "lm_head": "cpu"}, {"model": "cpu", "lm_head": "cpu"}),
    ],
)
def test_a_device_map_is_a_strategy_or_a_json_mapping_of_modules_to_devices(given, want):
    assert parse_device_map(given) == want
    assert EngineConfig(model="m", device_map=given).device_map == want


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("everywhere", "must be one of auto, balanced"),
        ("{not json", "not valid JSON"),
        ("{}", "non-empty mapping"),
        ('{"model": true}', "must map a module name to a device"),
        ('{"model.layers.0": 0, "model.layers.1": "cpu"}', "offloading"),
        ('{"model": "disk"}', "offloading"),
    ],
)
def test_a_bad_device_map_or_one_that_offloads_is_refused_before_loading(given, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", device_map=given)

"""Loading a transformers causal LM for specd's paged attention, and the checks that it can run there."""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, DistributedConfig

from engine.layers import attention
from engine.layers.kv_cache import LayerShape
from engine.types.config import DeviceMap

_PROBE_IMPL = "specd_probe"
# Attention features a model may ask for that SDPA over the paged cache would silently ignore.
_UNSUPPORTED_ATTENTION_KWARGS = {"softcap": "logit soft-capping", "s_aux": "sinks", "sinks": "sinks"}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture cannot run on specd's paged attention."""


def resolve_device(device: str) -> torch.device:
    resolved = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if resolved.type == "cuda" and resolved.index is None:
        # Indexed, so it compares equal to the device a tensor or a split model reports.
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # bf16 is the native fast path on GPUs; on CPU float32 matmuls are the fast (and exact) ones.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def device_map_kind(device_map: DeviceMap) -> torch.device:
    """The kind of device a device map places the model on, for the ``auto`` dtype: accelerate's
    strategies fill the GPUs when there are any; an explicit map names its devices."""
    if isinstance(device_map, str):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device("cpu" if {str(d) for d in device_map.values()} == {"cpu"} else "cuda")


def architectures(config: object, fallback: str) -> str:
    """The architectures a config names, for messages (``fallback`` when it names none)."""
    return ", ".join(getattr(config, "architectures", None) or [fallback])


def load_causal_lm(path: str, dtype: torch.dtype, device: str, trust_remote_code: bool = False,
                   device_map: DeviceMap | None = None, tensor_parallel: int = 1) -> torch.nn.Module:
    """The checkpoint at ``path`` in ``dtype``, on ``device`` or split by ``device_map`` (accelerate places the
    modules and moves activations between them), or this rank's shard of it by the architecture's own
    tensor-parallel plan (``tensor_parallel`` ranks, the process group already joined); refused when specd's
    attention cannot serve it."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    archs = architectures(config, config.model_type)
    sharding = {"distributed_config": DistributedConfig(tp_size=tensor_parallel)} if tensor_parallel > 1 else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="eager", device_map=device_map,
            **sharding,
        )
    except ValueError as exc:
        raise UnsupportedModelError(f"cannot load {path} ({archs}) as a causal LM: {exc}") from exc
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"architecture {archs} (model_type {config.model_type!r}) does not route attention through "
            "transformers' AttentionInterface, so specd cannot run it on a paged KV cache"
        )
    if sharding:
        return model  # each shard is already on its rank's device
    if device_map is None:
        return model.to(resolve_device(device))
    placed = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    if "disk" in placed or ("cpu" in placed and len(placed) > 1):
        # accelerate offloads what does not fit on the GPUs; offloaded layers run elsewhere than their
        # weights, copied in at every forward.
        raise ValueError(
            f"device_map {device_map!r} offloaded part of {path} to CPU or disk (placed on "
            f"{', '.join(sorted(placed))}): the model does not fit on the GPUs; add GPUs or give a map"
        )
    return model


def probe_layers(model: torch.nn.Module, device: torch.device) -> tuple[list[LayerShape], list[torch.device]]:
    """Each layer's K/V shape and the device its attention runs on, learnt by running one token, whatever the
    config calls them; refuses attention features the paged attention does not implement."""
    shapes: dict[int, LayerShape] = {}
    devices: dict[int, torch.device] = {}
    problems: set[str] = set()

    def record(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN003, ANN202
        shapes[module.layer_idx] = LayerShape(key.shape[1], key.shape[3], value.shape[3])
        devices[module.layer_idx] = key.device  # where this layer's attention runs: its cache goes there
        if kwargs.get(attention.METADATA_KWARG) is not sentinel:
            problems.add("decoder layers that do not pass keyword arguments on to attention (the paged "
                         "cache's metadata travels that way)")
        if not getattr(module, "is_causal", True):
            problems.add("bidirectional (non-causal) attention")
        for name in _UNSUPPORTED_ATTENTION_KWARGS:
            if kwargs.get(name) is not None:
                problems.add(f"attention {_UNSUPPORTED_ATTENTION_KWARGS[name]} ({name!r})")
        # What the paged attention will return: one value vector per query head.
        return query.new_zeros(*query.shape[:1], query.shape[2], query.shape[1], value.shape[3]), None

    sentinel = object()
    AttentionInterface.register(_PROBE_IMPL, record)
    model.set_attn_implementation(_PROBE_IMPL)
    archs = architectures(model.config, type(model).__name__)
    try:
        with torch.inference_mode():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False,
                  **{attention.METADATA_KWARG: sentinel})
    except (RuntimeError, ValueError, TypeError) as exc:
        raise UnsupportedModelError(f"architecture {archs} failed a one-token forward with specd's attention "
                                    f"output shape [tokens, heads, value head size]: {exc}") from exc
    if problems:
        raise UnsupportedModelError(f"architecture {archs} uses {', '.join(sorted(problems))}, which specd's "
                                    "paged attention does not implement")
    if not shapes or sorted(shapes) != list(range(len(shapes))):
        raise UnsupportedModelError(f"architecture {archs}: not every layer is a standard attention layer")
    return [shapes[i] for i in range(len(shapes))], [devices[i] for i in range(len(devices))]

"""Attention over a packed, paged batch, plugged into transformers' own model code.

transformers calls ``attention_interface(module, query, key, value, mask, **kwargs)`` from each
attention layer, and extra keyword arguments given to the model's forward reach it. We pass the
batch layout as ``specd_attn`` and do two things per layer: write the new K/V into the paged cache,
then attend each query token to its own sequence's cached K/V with a causal limit.

Sequences with few new tokens (decode and verify steps) are padded into one batched SDPA call (on the
CPU in float32, one call of engine.layers.cpu_attention's kernel, which reads the cache in place instead);
long chunks (prefill) get one call each, so padding never multiplies a long prompt's cost. A forward
in a static bucket shape (engine.worker.graphs) brings ``PaddedMetadata`` instead: every shape fixed by
the bucket, nothing computed from host values, so it can be captured as a CUDA graph. Such a
forward either gathers each sequence's keys into a padded copy (SDPA over it: the CPU's path) or,
with a ``PagedMask``, reads the cache in place through the block table with FlexAttention, whose
block-sparse kernel visits only the blocks a sequence owns (the GPU's path: no copy per layer).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention
from transformers import AttentionInterface

from engine.layers import cpu_attention
from engine.layers.attention_metadata import AttentionMetadata, PaddedMetadata, PagedMask, ShortGroup
from engine.layers.compile_limit import compile_with_limit
from engine.layers.tracing import tracing

ATTN_IMPL = "specd_paged"
METADATA_KWARG = "specd_attn"  # the keyword argument that carries AttentionMetadata through the model
# The eager path's shapes change every step (contexts grow; prefill chunks and a draft's catch-up come in
# every length). SDPA's cuDNN backend, which torch prefers on Hopper, builds a plan for each new shape:
# 10-20 ms a time, measured on an H200, where flash and memory-efficient kernels need none. The static
# buckets (engine.worker.graphs) keep cuDNN: their shapes are fixed, so each plan is built once, at capture.
_DYNAMIC_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


_FLEX: list = []  # the compiled flex_attention, made on first use (compiling at import would cost every process)


def flex() -> Callable[..., torch.Tensor]:
    """flex_attention compiled: eager flex_attention is a reference implementation, not a kernel."""
    if not _FLEX:
        # One graph per batch bucket and per model's head layout (the draft's differs from the target's):
        # more than dynamo's default of 8 recompilations of one function.
        _FLEX.append(compile_with_limit(flex_attention, 64, dynamic=False, fullgraph=True))
    return _FLEX[0]


def flex_supported(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int) -> bool:
    """Layers FlexAttention's short-query kernel takes: query heads per KV head a power of two, equal
    K and V widths (others keep the gather path)."""
    group = num_heads // num_kv_heads
    return num_heads % num_kv_heads == 0 and group & (group - 1) == 0 and head_dim == v_head_dim


def _window(qpos: torch.Tensor, kpos: torch.Tensor, window: int) -> torch.Tensor:
    """transformers' sliding-window convention: query at p sees keys in (p - window, p]."""
    return qpos[..., :, None] - kpos < window


# Attention layers run by Python rather than inside a compiled graph, per thread: a background compile's
# forwards must not count in the serving thread's.
_eager = threading.local()


def eager_calls() -> int:
    """How many attention layers ran eagerly so far in this thread: engine.worker.compiled reads it around a forward to
    tell whether dynamo ran its graph or fell back to the plain model."""
    return getattr(_eager, "calls", 0)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    specd_attn: AttentionMetadata | None = None,
    sliding_window: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    if specd_attn is None:
        raise RuntimeError(f"the {ATTN_IMPL!r} attention needs specd_attn metadata: run the model through ModelRunner")
    if not tracing():  # while tracing this is skipped, so a compiled graph never counts
        _eager.calls = getattr(_eager, "calls", 0) + 1
    if isinstance(specd_attn, PaddedMetadata):
        return _padded_attention(module.layer_idx, query, key, value, scaling, specd_attn.on(query.device),
                                 sliding_window), None
    meta = specd_attn.on(query.device)
    if query.is_cuda:
        with sdpa_kernel(_DYNAMIC_BACKENDS):
            return _dynamic_attention(module.layer_idx, query, key, value, scaling, meta, sliding_window), None
    return _dynamic_attention(module.layer_idx, query, key, value, scaling, meta, sliding_window), None


def _dynamic_attention(
    layer: int,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, Dv]
    scaling: float | None,
    meta: AttentionMetadata,
    sliding_window: int | None,
) -> torch.Tensor:
    """The eager path: shapes as this step's batch has them. [1, T, H, Dv]"""
    k_cache, v_cache = meta.cache.k[layer], meta.cache.v[layer]  # [slots, Hkv, D]
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    k_cache.index_copy_(0, meta.slot_mapping, k_new.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v_new.to(v_cache.dtype))
    gqa = query.shape[1] != key.shape[1]
    q_all = query[0].transpose(0, 1)  # [T, H, D]
    out = q_all.new_empty(*q_all.shape[:2], value.shape[3])  # [T, H, Dv]

    g = meta.short
    if g is not None:
        o = _short_attention(q_all, k_cache, v_cache, scaling, g, sliding_window, gqa)  # [G, Q, H, Dv]
        if g.real is None:  # every sequence is here with Q tokens: the rows are o's, in order
            return o.reshape(1, -1, *out.shape[1:])  # [1, T, H, Dv]
        assert g.real_rows is not None
        out.index_copy_(0, g.real_rows, o.reshape(-1, *out.shape[1:]).index_select(0, g.real))
    _long_attention(meta, q_all, k_new, v_new, k_cache, v_cache, out, scaling, sliding_window, gqa)
    return out[None]  # [1, T, H, Dv]


def _short_attention(
    q_all: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, Dv]
    scaling: float | None,
    g: ShortGroup,
    sliding_window: int | None,
    gqa: bool,
) -> torch.Tensor:
    """The short group's queries over their contexts: [G, Q, H, Dv]."""
    G, Q = g.positions.shape
    # The common decode/verify step: a reshape instead of a gather and a masked scatter.
    q = q_all.view(G, Q, *q_all.shape[1:]) if g.rows is None else q_all[g.rows]  # [G, Q, H, D]
    if g.slots is not None and cpu_attention.usable(q, k_cache, v_cache, sliding_window):
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        return cpu_attention.paged_attention(q, k_cache, v_cache, g.slots, g.positions, scale)
    q = q.permute(0, 2, 1, 3)  # [G, H, Q, D]
    # index_select over the flat slot list: several times faster on CPU than advanced indexing.
    if g.span is not None:
        k = k_cache.narrow(0, *g.span)[None].permute(0, 2, 1, 3)  # [1, Hkv, C, D], no copy
        v = v_cache.narrow(0, *g.span)[None].permute(0, 2, 1, 3)
    else:
        assert g.slots is not None
        flat = g.slots.view(-1)
        k = k_cache.index_select(0, flat).view(G, -1, *k_cache.shape[1:]).permute(0, 2, 1, 3)  # [G, Hkv, C, D]
        v = v_cache.index_select(0, flat).view(G, -1, *v_cache.shape[1:]).permute(0, 2, 1, 3)  # [G, Hkv, C, D]
    mask = g.mask
    if sliding_window is not None:
        kpos = torch.arange(k.shape[2], device=q.device)
        mask = _window(g.positions, kpos, sliding_window)[:, None]  # [G, 1, Q, C]
        # Padding queries (position 0) pass every window test; g.mask leaves them key 0.
        mask = mask if g.mask is None else mask & g.mask
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)  # [G, H, Q, Dv]
    return o.permute(0, 2, 1, 3)


def _long_attention(
    meta: AttentionMetadata,
    q_all: torch.Tensor,  # [T, H, D]
    k_new: torch.Tensor,  # [T, Hkv, D]
    v_new: torch.Tensor,  # [T, Hkv, Dv]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, Dv]
    out: torch.Tensor,  # [T, H, Dv], written in place
    scaling: float | None,
    sliding_window: int | None,
    gqa: bool,
) -> None:
    """One SDPA call per long sequence, over its cached context (or only its fresh tokens)."""
    for s in meta.long:
        q = q_all[s.rows].transpose(0, 1)[None]  # [1, H, q, D]
        if s.fresh:
            k, v = k_new[s.rows].transpose(0, 1)[None], v_new[s.rows].transpose(0, 1)[None]  # [1, Hkv, q, D]
        else:
            k = k_cache.index_select(0, s.slots).transpose(0, 1)[None]  # [1, Hkv, C, D]
            v = v_cache.index_select(0, s.slots).transpose(0, 1)[None]
        mask = s.mask
        if sliding_window is not None:
            mask = mask & _window(s.positions, torch.arange(s.slots.numel(), device=mask.device), sliding_window)
        elif s.fresh:
            # A whole prompt in one chunk is plainly causal: saying so instead of passing the mask lets
            # SDPA pick its flash kernel (CUDA, and CPU), which takes no explicit mask.
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
            out[s.rows] = o[0].transpose(0, 1)
            continue
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)  # [1, H, q, D]
        out[s.rows] = o[0].transpose(0, 1)


def _padded_attention(
    layer: int,
    query: torch.Tensor,  # [1, H, G * Q, D]
    key: torch.Tensor,  # [1, Hkv, G * Q, D]
    value: torch.Tensor,  # [1, Hkv, G * Q, Dv]
    scaling: float | None,
    meta: PaddedMetadata,
    sliding_window: int | None,
) -> torch.Tensor:
    """Static shapes only: each sequence's queries over its C gathered keys in one SDPA call."""
    k_cache, v_cache = meta.cache.k[layer], meta.cache.v[layer]  # [slots, Hkv, D]
    k_cache.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1).to(v_cache.dtype))
    G, Q = meta.positions.shape
    C = meta.key_slots.shape[1]
    q = query[0].unflatten(1, (G, Q)).transpose(0, 1)  # [G, H, Q, D]
    gqa = query.shape[1] != key.shape[1]
    if meta.paged is not None and flex_supported(query.shape[1], key.shape[1], query.shape[3], value.shape[3]):
        o = _paged_flex(q, k_cache, v_cache, scaling, meta.paged, meta.cache.block_size, sliding_window, gqa)
        return o.transpose(1, 2).reshape(1, G * Q, o.shape[1], o.shape[3])
    flat = meta.key_slots.view(-1)
    k = k_cache.index_select(0, flat).view(G, C, *k_cache.shape[1:]).transpose(1, 2)  # [G, Hkv, C, D]
    v = v_cache.index_select(0, flat).view(G, C, *v_cache.shape[1:]).transpose(1, 2)  # [G, Hkv, C, Dv]
    mask = meta.mask
    if sliding_window is not None:
        # Every row, padding too, sees at least the key at its own position: no all-masked row, no NaN.
        mask = mask & _window(meta.positions, torch.arange(C, device=q.device), sliding_window)[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)  # [G, H, Q, Dv]
    return o.transpose(1, 2).reshape(1, G * Q, o.shape[1], o.shape[3])  # [1, G * Q, H, Dv]


def _paged_flex(
    q: torch.Tensor,  # [G, H, Q, D]
    k_cache: torch.Tensor,  # [slots + 1, Hkv, D]
    v_cache: torch.Tensor,  # [slots + 1, Hkv, Dv]
    scaling: float | None,
    paged: PagedMask,
    block_size: int,
    sliding_window: int | None,
    gqa: bool,
) -> torch.Tensor:
    """Each sequence's queries over its own blocks, read in place: [G, H, Q, Dv]. Queries are padded to
    the largest query bucket (rows past Q are discarded), so flex_attention compiles one shape per batch."""
    G, Q = q.shape[0], q.shape[2]
    Qm = paged.positions.shape[1]
    n = (paged.logical.shape[1] - 1) * block_size  # the scratch slot is no key
    k = k_cache[:n].permute(1, 0, 2)[None].expand(G, -1, -1, -1)  # [G, Hkv, slots, D], a view
    v = v_cache[:n].permute(1, 0, 2)[None].expand(G, -1, -1, -1)
    q = F.pad(q, (0, 0, 0, Qm - Q))  # [G, H, Q_max, D]
    score_mod = None
    if sliding_window is not None:
        logical, positions, window = paged.logical, paged.positions, sliding_window

        def score_mod(score, b, h, qi, ki):  # noqa: ANN001, ANN202
            kpos = logical[b, ki // block_size] * block_size + ki % block_size
            return torch.where(positions[b, qi] - kpos < window, score, -float("inf"))

    o = flex()(q, k, v, score_mod=score_mod, block_mask=paged.block_mask, scale=scaling, enable_gqa=gqa)
    return o[:, :, :Q]


def register() -> None:
    """Idempotent: registering replaces the same name with the same function."""
    AttentionInterface.register(ATTN_IMPL, paged_attention_forward)

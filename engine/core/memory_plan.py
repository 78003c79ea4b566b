"""How a device's memory is shared out: the weights, the largest forward's activations, then the KV cache.

Pure arithmetic on sizes, so that a real start (engine.core.loader, sizes measured on the loaded models) and
``specd serve --dry-run`` (sizes from the configs on the meta device) plan alike and fail with the same errors.

On CUDA, ``share`` (memory_utilization, 0.9 by default) is the part of the whole device specd may use: the KV cache
gets what is left of it after the weights and the activations. On a CPU, whose RAM the rest of the machine shares,
the cache gets ``share`` (a quarter by default) of the RAM that was available besides the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.types.config import MIN_SCORING_CHUNK

GiB = 2**30
MIN_FULL_LENGTH = 4  # sequences of the whole context that must fit at once when the context is left to the plan
MIN_CONTEXT = 256  # a context the plan would cap below this is an error, not a server
DEFAULT_SHARE = {"cuda": 0.9, "cpu": 0.25}


class PlanError(ValueError):
    """What a real start would refuse, with the way out."""


@dataclass(frozen=True)
class ModelSize:
    """What the plan needs of one model: its weights, its KV per cache block, and an activation estimate's sizes."""

    weight_bytes: int
    block_bytes: int  # one block of the KV cache, every layer
    hidden: int
    intermediate: int
    vocab: int


@dataclass(frozen=True)
class PlanRequest:
    device: str  # "cuda" or "cpu": what the memory is
    memory_bytes: int  # the device's memory; on CPU, the RAM available before the weights were loaded
    share: float | None  # memory_utilization; None = DEFAULT_SHARE
    target: ModelSize
    draft: ModelSize | None
    dtype_bytes: int
    block_size: int
    k_max: int
    max_num_seqs: int
    max_num_batched_tokens: int
    model_limit: int
    max_model_len: int | None  # None = the model's limit, capped so MIN_FULL_LENGTH sequences fit
    cuda_graphs: bool
    kv_cache_bytes: int | None = None  # an explicit KV budget (kv_cache_memory_gb)
    num_kv_blocks: int | None = None  # an explicit block count
    split: bool = False  # the target spread over devices (device_map): only the KV budget is planned
    ranks: int = 1  # tensor-parallel ranks: the sizes are rank 0's (its shard, its KV heads, the draft)


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    memory_bytes: int
    share: float
    weight_bytes: int
    draft_weight_bytes: int
    activation_bytes: int
    block_bytes: int  # target's and draft's layers together
    num_blocks: int
    block_size: int
    k_max: int
    max_model_len: int
    model_limit: int
    sizing: str  # where the block count came from
    warnings: tuple[str, ...]
    ranks: int = 1

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def full_length_sequences(self) -> int:
        return self.num_blocks // blocks_per_sequence(self.max_model_len, self.k_max, self.block_size)

    def describe(self) -> str:
        """The start-up log's one block."""
        g = GiB
        draft = self.draft_weight_bytes
        whole = f"{self.memory_bytes / g:.1f} GiB of {self.device}"
        lines = [
            f"memory plan ({self.sizing})" + (f", per rank of {self.ranks}:" if self.ranks > 1 else ":"),
            f"  device       {whole}" + (f", {self.share:g} for specd" if self.device == "cuda" else
                                         f" available, {self.share:g} of it (less the weights) for the KV cache"),
            f"  weights      {self.weight_bytes / g:.2f} GiB"
            + (f" (draft {draft / g:.2f} GiB, {draft / max(1, self.weight_bytes):.0%})" if draft else ""),
            f"  activations  {self.activation_bytes / g:.2f} GiB (estimated peak of the largest forward)",
            f"  KV cache     {self.kv_bytes / g:.2f} GiB: {self.num_blocks} blocks x {self.block_size} tokens "
            f"= {self.num_blocks * self.block_size} tokens",
            f"  context      {self.max_model_len} tokens (the model's limit: {self.model_limit}); "
            f"{self.full_length_sequences} full-length sequences fit at once",
        ]
        return "\n".join(lines)


def blocks_per_sequence(tokens: int, k_max: int, block_size: int) -> int:
    """Blocks one sequence of ``tokens`` needs, with room for a verify's k_max drafts and the token after them."""
    return -(-(tokens + k_max + 1) // block_size)


def forward_bytes(size: ModelSize, tokens: int, logit_rows: int, dtype_bytes: int) -> int:
    """An estimate of a forward's peak beyond weights and cache. At any one time a layer holds the residual stream,
    its normed copy, q/k/v and the attention output (about 4 x hidden a token) and the MLP's gate, up and their
    product (3 x intermediate), in the model's dtype; then the logits of the rows sampled."""
    return (tokens * (4 * size.hidden + 3 * size.intermediate) + logit_rows * size.vocab) * dtype_bytes


def activation_bytes(r: PlanRequest) -> int:
    """The largest forward (a prefill chunk of the token budget, or every sequence's verify), the most rows of
    logits a step takes in float32 (logits and probabilities: every sequence's verify, or a chunk of a prompt being
    scored, EngineConfig.logit_rows), and with CUDA graphs each model's private pool, as large as its largest
    bucket's forward (graphs are captured largest first into it)."""
    models = [m for m in (r.target, r.draft) if m is not None]
    rows = max(r.max_num_seqs * (r.k_max + 1), MIN_SCORING_CHUNK)
    tokens = max(r.max_num_batched_tokens, rows)
    act = max(forward_bytes(m, tokens, rows, r.dtype_bytes) for m in models) + rows * r.target.vocab * 4 * 2
    if r.cuda_graphs:
        act += sum(forward_bytes(m, rows, rows, r.dtype_bytes) for m in models)
    return act


def plan_memory(r: PlanRequest) -> MemoryPlan:
    share = DEFAULT_SHARE[r.device] if r.share is None else r.share
    if not 0 < share <= 1:
        raise PlanError(f"memory_utilization must be in (0, 1], got {share}")
    models = [m for m in (r.target, r.draft) if m is not None]
    weights = sum(m.weight_bytes for m in models)
    block_bytes = sum(m.block_bytes for m in models)
    act = activation_bytes(r)
    if r.max_model_len is not None and r.max_model_len > r.model_limit:
        raise PlanError(f"max_model_len {r.max_model_len} exceeds the model's limit of {r.model_limit}")

    warnings: list[str] = []
    if r.split:
        warnings.append("the target is split across devices (device_map): the plan sizes the KV cache from "
                        "kv_cache_memory_gb alone and does not check the weights against any one device")
    if r.num_kv_blocks is not None:
        blocks, sizing = r.num_kv_blocks, f"num_kv_blocks {r.num_kv_blocks}"
    elif r.kv_cache_bytes is not None:
        blocks = r.kv_cache_bytes // block_bytes
        sizing = f"budget {r.kv_cache_bytes / GiB:g} GiB = {blocks} blocks"
        room = r.memory_bytes - weights - act
        if r.device == "cuda" and not r.split and r.kv_cache_bytes > room:
            raise PlanError(
                f"kv_cache_memory_gb {r.kv_cache_bytes / GiB:g} does not fit beside the weights "
                f"({weights / GiB:.1f} GiB) and activations ({act / GiB:.1f} GiB) in {r.memory_bytes / GiB:.1f} GiB: "
                f"at most {max(0, room) / GiB:.1f} fits; leave it unset for the memory plan's")
    else:
        if r.device == "cuda":
            usable = int(share * r.memory_bytes) - weights - act
            what = f"memory_utilization {share:g} of {r.memory_bytes / GiB:.1f} GiB"
        else:
            usable = int(share * (r.memory_bytes - weights))
            what = f"{share:g} of the {(r.memory_bytes - weights) / GiB:.1f} GiB of RAM available besides the weights"
        least = blocks_per_sequence(min(MIN_CONTEXT, r.model_limit), r.k_max, r.block_size) * block_bytes
        if usable < least:
            raise PlanError(
                f"the model does not fit: weights {weights / GiB:.1f} GiB and activations {act / GiB:.1f} GiB leave "
                f"{max(0, usable) / GiB:.2f} GiB for the KV cache within {what}, short by "
                f"{(least - usable) / GiB:.1f} GiB; shard the target over GPUs (--tensor-parallel-size "
                f"{2 * r.ranks}), split it across them (--device-map auto), use a quantised checkpoint or a smaller "
                "model"
                + (", or raise --memory-utilization" if share < 0.95 and r.device == "cuda" else ""))
        blocks, sizing = usable // block_bytes, what

    limit = r.model_limit
    if r.max_model_len is not None:
        context = r.max_model_len
        if blocks < blocks_per_sequence(context, r.k_max, r.block_size):
            fits = blocks * r.block_size - r.k_max - 1
            raise PlanError(
                f"max_model_len {context} does not fit: the KV cache holds {blocks} blocks of {r.block_size} tokens "
                f"({sizing}), and the largest max_model_len that fits is {max(0, fits)}")
    else:
        context = limit
        if r.num_kv_blocks is None and blocks < MIN_FULL_LENGTH * blocks_per_sequence(limit, r.k_max, r.block_size):
            context = (blocks // MIN_FULL_LENGTH) * r.block_size - r.k_max - 1
            context -= context % r.block_size
            if context < min(MIN_CONTEXT, limit):
                raise PlanError(
                    f"the KV cache ({sizing}: {blocks} blocks of {r.block_size} tokens) holds {MIN_FULL_LENGTH} "
                    f"sequences of only {max(0, context)} tokens; free memory, or give --max-model-len and "
                    f"--kv-cache-memory-gb")
            warnings.append(
                f"max_model_len capped at {context} (the model's limit is {limit}) so that {MIN_FULL_LENGTH} "
                f"full-length sequences fit in the KV cache; --max-model-len up to "
                f"{min(limit, blocks * r.block_size - r.k_max - 1)} fits fewer at once")
    if r.num_kv_blocks is None:
        per = blocks_per_sequence(context, r.k_max, r.block_size)
        if blocks > per * r.max_num_seqs:  # more than every running sequence at full length is never used
            blocks = per * r.max_num_seqs
            sizing = f"{sizing}, capped at max_num_seqs {r.max_num_seqs} x {per} blocks per sequence"
    if blocks < blocks_per_sequence(context, r.k_max, r.block_size):
        raise PlanError(f"the KV cache holds {blocks} blocks of {r.block_size} tokens, fewer than one sequence of "
                        f"max_model_len {context} needs; raise the KV budget or lower max_model_len")
    return MemoryPlan(r.device, r.memory_bytes, share, weights, r.draft.weight_bytes if r.draft else 0, act,
                      block_bytes, blocks, r.block_size, r.k_max, context, limit, sizing, tuple(warnings), r.ranks)


def parse_size(text: str) -> int:
    """'80GiB', '24 GB', '512MiB', or bytes."""
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": GiB, "tib": 2**40, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "tb": 10**12}
    t = text.strip().lower().replace(" ", "")
    number = t.rstrip("kmgtib")
    unit = t[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in units or not value > 0:
        raise ValueError(f"not a memory size: {text!r} (e.g. 80GiB, 24GB, 512MiB)")
    return int(value * units[unit])

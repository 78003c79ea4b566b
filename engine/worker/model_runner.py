"""Loads a transformers causal LM and runs it on packed, paged batches."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

from engine.layers import attention, cpu_attention, small_linear
from engine.layers.kv_cache import LayerShape, PagedKVCache
from engine.models.early_exit import decoder_layers, truncate
from engine.types.config import DeviceMap
from engine.types.schedule import ScheduledSeq
from engine.worker.compiled import CompiledForward, warm_up
from engine.worker.graphs import Buckets, StaticForward
from engine.worker.layout import plan_layout
from engine.worker.staging import Uploader

logger = logging.getLogger(__name__)

_PROBE_IMPL = "specd_probe"
# Attention features a model may ask for that SDPA over the paged cache would silently ignore.
_UNSUPPORTED_ATTENTION_KWARGS = {"softcap": "logit soft-capping", "s_aux": "sinks", "sinks": "sinks"}


# The warm-up's sequences: their context, and the rows of its batched layouts (two such sequences are past
# small_linear's fused products: the graph batched steps use).
_WARM_UP_CONTEXT = 40
_WARM_UP_ROWS = small_linear.SMALL_ROWS // 2 + 1


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


@dataclass(frozen=True)
class ForwardBatch:
    """One packed forward: sequence i feeds ``token_ids[i]`` at positions ``[starts[i], ...)``."""

    token_ids: list[list[int]]
    starts: list[int]
    block_tables: list[list[int]]
    logits_rows: list[int]  # per sequence: how many trailing positions need logits (0 = none)
    # The tokens as a [T] tensor already on the device (a draft loop's previous output): token_ids then
    # only say how many tokens each sequence feeds, and nothing is copied from the host.
    input_ids: torch.Tensor | None = None

    def ids(self, device: torch.device) -> torch.Tensor:
        """The fed tokens as [1, T] on ``device``."""
        if self.input_ids is not None:
            return self.input_ids.view(1, -1)
        return torch.tensor([[t for toks in self.token_ids for t in toks]], dtype=torch.long, device=device)

    def logits_row_index(self) -> tuple[list[int], int]:
        """The packed rows that need logits, in order, and the number of rows T."""
        keep, end = [], 0
        for toks, r in zip(self.token_ids, self.logits_rows):
            end += len(toks)
            keep.extend(range(end - r, end))
        return keep, end


def step_batch(scheduled: list[ScheduledSeq], drafts: list[list[int]]) -> ForwardBatch:
    """The step's one target pass: each sequence's uncomputed tokens plus its drafts. Sequences that
    reach their last known token get logits for it and every draft position."""
    feeds, rows = [], []
    for s, d in zip(scheduled, drafts):
        seq = s.seq
        feeds.append(seq.token_ids[seq.num_computed : seq.num_computed + s.num_new_tokens] + d)
        rows.append(len(d) + 1 if s.samples else 0)
    return ForwardBatch(feeds, [s.seq.num_computed for s in scheduled], [s.seq.block_table for s in scheduled], rows)


class ModelRunner:
    """One model, one KV cache. The target and the draft model each get their own runner."""

    def __init__(
        self, path: str, dtype: str, device: str, trust_remote_code: bool = False, device_map: DeviceMap | None = None,
        compile: bool = False,
    ) -> None:
        """``device_map`` splits the model across devices (accelerate places the modules and moves
        activations between them); ``device`` is then unused. ``compile``: decode and verify forwards
        run through torch.compile (engine.worker.compiled), after ``warm_up_compiled``."""
        attention.register()
        self.dtype = resolve_dtype(dtype, resolve_device(device) if device_map is None else device_map_kind(device_map))
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        archs = ", ".join(getattr(config, "architectures", None) or [config.model_type])
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=self.dtype, trust_remote_code=trust_remote_code, attn_implementation="eager",
                device_map=device_map,
            )
        except ValueError as exc:
            raise UnsupportedModelError(f"cannot load {path} ({archs}) as a causal LM: {exc}") from exc
        if not getattr(model, "_supports_attention_backend", False):
            raise UnsupportedModelError(
                f"architecture {archs} (model_type {config.model_type!r}) does not route attention through "
                "transformers' AttentionInterface, so specd cannot run it on a paged KV cache"
            )
        if device_map is None:
            model = model.to(resolve_device(device))
        else:
            placed = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
            if "disk" in placed or ("cpu" in placed and len(placed) > 1):
                # accelerate offloads what does not fit on the GPUs; offloaded layers run elsewhere than their
                # weights, copied in at every forward.
                raise ValueError(
                    f"device_map {device_map!r} offloaded part of {path} to CPU or disk (placed on "
                    f"{', '.join(sorted(placed))}): the model does not fit on the GPUs; add GPUs or give a map"
                )
        self._adopt(model, path, split=device_map is not None, compile=compile)

    @classmethod
    def from_model(cls, model: torch.nn.Module, name: str, compile: bool = False) -> ModelRunner:
        """A runner around a model already built and placed (benchmarks build random ones of real sizes
        on the GPU this way, without writing gigabytes of weights to disk first)."""
        attention.register()
        runner = cls.__new__(cls)
        runner.dtype = next(model.parameters()).dtype
        runner._adopt(model, name, split=False, compile=compile)
        return runner

    @classmethod
    def early_exit(cls, target: ModelRunner, num_layers: int, exit_head: torch.nn.Module | None = None) -> ModelRunner:
        """The target's first ``num_layers`` layers, then its final norm and LM head (or ``exit_head``, a trained
        replacement: engine.models.exit_head), as a runner of its own over the target's own KV cache
        (engine.models.early_exit): its forwards write those layers' K/V exactly where the target's would. Build it
        after the target's ``allocate_cache``."""
        assert target.cache is not None, "allocate the target's cache first"
        runner = cls.__new__(cls)
        runner.dtype, runner.device, runner.split = target.dtype, target.device, target.split
        runner.upload = Uploader(runner.device)
        runner.model = truncate(target.model, len(target.layer_shapes), num_layers)
        if exit_head is not None:
            head = target.model.get_output_embeddings()
            # truncate gave the short model its own child dict: replacing its head leaves the target's in place
            name = next(n for n, m in runner.model.named_children() if m is head)
            runner.model._modules[name] = exit_head.to(head.weight.device, target.dtype)
        runner._rows = threading.local()
        # The head is the target's own module (unless an exit head replaced it): both runners' row selections
        # hook it, each a no-op while its own runner is not the one running.
        runner.model.get_output_embeddings().register_forward_pre_hook(runner._select_rows)
        runner.vocab_size, runner.max_position_embeddings = target.vocab_size, target.max_position_embeddings
        runner.layer_devices = target.layer_devices[:num_layers]
        runner.layer_shapes = target.layer_shapes[:num_layers]
        runner.cache, runner.static = target.cache, None
        runner.aux_ids, runner.aux = (), None
        runner.name = f"{target.name} layers [0, {num_layers})"
        runner.compiled = CompiledForward(runner.model, runner.name) if target.compiled is not None else None
        return runner

    def _adopt(self, model: torch.nn.Module, name: str, split: bool, compile: bool) -> None:
        archs = ", ".join(getattr(model.config, "architectures", None) or [type(model).__name__])
        # Inputs go where the embeddings are; a split model's accelerate hooks carry activations on from there.
        self.device = model.get_input_embeddings().weight.device
        self.upload = Uploader(self.device)
        self.model = model.eval()
        self.split = split
        head = self.model.get_output_embeddings()
        if head is None:
            raise UnsupportedModelError(f"architecture {archs} has no output embeddings (LM head)")
        # The LM head runs on the rows that need logits only, selected just before it on its own device (a split
        # model's last): transformers' logits_to_keep would index there with a tensor from the first device. Per
        # thread (``keep``), as a background compile's forwards run beside the serving thread's (dynamo guards the
        # attribute read like any other).
        self._rows = threading.local()
        head.register_forward_pre_hook(self._select_rows)
        text_config = self.model.config.get_text_config()
        self.vocab_size: int = text_config.vocab_size
        self.max_position_embeddings: int | None = getattr(text_config, "max_position_embeddings", None)
        self.layer_devices: list[torch.device] = []
        self.layer_shapes = self._probe_layer_shapes()
        self.model.set_attn_implementation(attention.ATTN_IMPL)
        if self.dtype == torch.float32 and any(d.type == "cpu" for d in self.layer_devices or [self.device]):
            # Built now rather than inside the first forward: a compiled forward would meet the build (file I/O, a
            # compiler) while tracing and break its graph there.
            cpu_attention.kernel()
        self.cache: PagedKVCache | None = None
        self.static: StaticForward | None = None
        self.name = name
        self.compiled = CompiledForward(self.model, name) if compile else None
        self.aux_ids: tuple[int, ...] = ()
        self.aux: torch.Tensor | None = None

    def capture_aux(self, layer_ids: tuple[int, ...]) -> None:
        """Keep, from every forward from now on, the inputs of these decoder layers (index 0: the embedding
        output), concatenated: ``self.aux`` [T, len(layer_ids) * hidden], a row per fed token. EAGLE heads
        read them. Not with static buckets (their rows are padded)."""
        layers = decoder_layers(self.model, len(self.layer_shapes))
        parts: dict[int, torch.Tensor] = {}
        self._aux_parts = parts

        def keep(i: int):  # noqa: ANN202
            def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:  # noqa: ANN001
                parts[i] = args[0] if args else kwargs["hidden_states"]
            return hook

        for i in dict.fromkeys(layer_ids):
            layers[i].register_forward_pre_hook(keep(i), with_kwargs=True)
        self.aux_ids = tuple(layer_ids)

    def _select_rows(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        keep = getattr(self._rows, "keep", None)
        if keep is None:
            return None
        hidden = args[0]  # [1, T, hidden]
        # index_select: on CPU far cheaper than advanced indexing (~10 ms a call on a 32-sequence bf16 batch).
        return (hidden.index_select(1, keep.to(hidden.device)), *args[1:])

    def _probe_layer_shapes(self) -> list[LayerShape]:
        """Learn each layer's K/V shape by running one token, whatever the config calls them."""
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
        self.model.set_attn_implementation(_PROBE_IMPL)
        archs = ", ".join(getattr(self.model.config, "architectures", None) or [type(self.model).__name__])
        try:
            with torch.inference_mode():
                self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device), use_cache=False,
                           **{attention.METADATA_KWARG: sentinel})
        except (RuntimeError, ValueError, TypeError) as exc:
            raise UnsupportedModelError(f"architecture {archs} failed a one-token forward with specd's attention "
                                        f"output shape [tokens, heads, value head size]: {exc}") from exc
        if problems:
            raise UnsupportedModelError(f"architecture {archs} uses {', '.join(sorted(problems))}, which specd's "
                                        "paged attention does not implement")
        if not shapes or sorted(shapes) != list(range(len(shapes))):
            raise UnsupportedModelError(f"architecture {archs}: not every layer is a standard attention layer")
        self.layer_devices = [devices[i] for i in range(len(devices))]
        return [shapes[i] for i in range(len(shapes))]

    def bytes_per_block(self, block_size: int) -> int:
        return PagedKVCache.bytes_per_block(self.layer_shapes, block_size, self.dtype)

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        self.cache = PagedKVCache(self.layer_shapes, num_blocks, block_size, self.dtype, self.layer_devices)
        self.static = None

    def use_buckets(self, buckets: Buckets, paged_kernel: bool = False) -> None:
        """Run short-query forwards padded to ``buckets`` (engine.worker.graphs): CUDA graphs on a GPU, the
        same padded forward eagerly on CPU. Not for a model split across devices."""
        assert self.cache is not None, "allocate_cache() first"
        if self.split:
            raise ValueError("static buckets and CUDA graphs need the model on one device (no device_map)")
        if self.aux_ids:
            raise ValueError("static buckets and CUDA graphs do not yet hand an EAGLE head the target's hidden states")
        call = self.compiled.fn if self.compiled is not None else None
        self.static = StaticForward(self.model, self.cache, buckets, self.device, self.name, call, paged_kernel)

    @staticmethod
    def warm_up_blocks(k_max: int, block_size: int) -> int:
        """The blocks ``warm_up_compiled`` writes into, at most."""
        return 2 * -(-(_WARM_UP_CONTEXT + max(k_max + 1, 2 * _WARM_UP_ROWS)) // block_size)

    def warm_up_compiled(self, k_max: int, first_block: int = 0) -> float:
        """Compile the layouts decode, verify and draft catch-up steps use, before any request runs them: one
        sequence (its blocks in order or not) decoding, verifying k_max drafts or catching up, and two
        sequences over a gathered cache, masked or not, within small_linear.SMALL_ROWS rows and past it.
        Writes into blocks ``first_block`` on (``warm_up_blocks`` of them, fewer in a small cache), which
        nobody may own: unowned ones at start-up, or ones kept out of the block manager for a background
        compile. Returns the seconds it took (0 without compile)."""
        if self.compiled is None:
            return 0.0
        assert self.cache is not None
        bs, n = self.cache.block_size, self.cache.num_blocks - first_block
        big = _WARM_UP_ROWS
        extra = max(k_max + 1, 2 * big)  # the most tokens one sequence feeds
        # two sequences' worth of blocks, even in a small cache
        ctx = max(2, min(_WARM_UP_CONTEXT, (n // 2) * bs - extra))
        need = -(-(ctx + extra) // bs)
        one = list(range(first_block, first_block + need))
        other = list(range(first_block + 2 * need - 1, first_block + need - 1, -1))
        # dynamo specialises on which of the layout's optional parts are present (a contiguous span, a mask,
        # a selection of logits rows): one layout per combination a step can bring, or the first request
        # that brings a new one waits for its compile.
        layouts = [
            ForwardBatch([[0]], [ctx], [table], [1])
            for table in (one, other)  # blocks in order (read as one span) or not (gathered)
        ] + [
            ForwardBatch([[0] * rows], [ctx], [table], [rows])
            # past SMALL_ROWS, verifying fewer drafts than k_max is another graph
            for rows in sorted({k_max + 1, min(k_max + 1, small_linear.SMALL_ROWS)}) for table in (one, other)
        ] + [
            ForwardBatch([[0] * rows], [ctx], [table], [1])
            # a catch-up or a short prompt: one row's logits, from at most SMALL_ROWS rows or more (a prompt of
            # up to attention.SHORT_QUERY tokens arriving alone ran eagerly until this layout was here)
            for rows in (3, 2 * big) for table in (one, other)
        ] + [
            ForwardBatch([[0], [0]], [ctx, ctx // 2], [one, other], [1, 1]),
            ForwardBatch([[0], [0]], [ctx, ctx], [one, other], [1, 1]),  # equal contexts: no mask
            ForwardBatch([[0] * (k_max + 1), [0]], [ctx, ctx // 2], [one, other], [k_max + 1, 1]),
            ForwardBatch([[0] * (k_max + 1)] * 2, [ctx, ctx // 2], [one, other], [k_max + 1] * 2),  # all verifying
            ForwardBatch([[0] * 3, [0] * 2], [ctx, ctx // 2], [one, other], [1, 1]),
            # every sequence feeding as many tokens, one logits row each: a draft model catching up a batch whose
            # drafts were all accepted, or short prompts of one length admitted together (ran eagerly until
            # this layout was here), within SMALL_ROWS rows and past it
            ForwardBatch([[0] * 2] * 2, [ctx, ctx // 2], [one, other], [1, 1]),
            ForwardBatch([[0] * 2] * big, [ctx, ctx // 2] * (big // 2) + [ctx], [one, other] * (big // 2) + [one],
                         [1] * big),
            # and more of them than the LM head's SMALL_ROWS (it then takes its rows packed)
            ForwardBatch([[0] * 2] * (2 * big), [ctx, ctx // 2] * big, [one, other] * big, [1] * (2 * big)),
            ForwardBatch([[0] * big] * 2, [ctx, ctx // 2], [one, other], [big] * 2),
            ForwardBatch([[0] * big, [0] * (big - 1)], [ctx, ctx // 2], [one, other], [big, big - 1]),  # mixed k
            # short prompts admitted together, of unequal lengths
            ForwardBatch([[0] * big, [0] * (big - 1)], [ctx, ctx // 2], [one, other], [1, 1]),
            # more sequences decoding than small_linear's rows (the sequences share blocks: nothing reads them)
            ForwardBatch([[0]] * (2 * big), [ctx, ctx // 2] * big, [one, other] * big, [1] * (2 * big)),
            # and a draft model catching up some of them, one logits row each
            ForwardBatch([[0] * 2] + [[0]] * (2 * big - 1), [ctx, ctx // 2] * big, [one, other] * big, [1] * (2 * big)),
        ]
        seconds = warm_up([lambda b=b: self.forward(b) for b in layouts], self.name)
        self.compiled.frozen = True
        logger.info("compiled the decode and verify forwards of %s in %.1fs", self.name, seconds)
        return seconds

    def synchronize(self) -> None:
        """Wait for queued GPU work, so wall-clock timings mean something."""
        for device in dict.fromkeys(self.layer_devices or [self.device]):
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Returns float32 logits ``[sum(logits_rows), vocab]`` on ``self.device``: for each sequence in
        order, its last ``logits_rows[i]`` positions. The LM head runs only on those rows."""
        assert self.cache is not None, "allocate_cache() first"
        ends = [s + len(t) for s, t in zip(batch.starts, batch.token_ids)]
        bucket = self.static.fits([len(t) for t in batch.token_ids], ends) if self.static is not None else None
        if bucket is not None:
            assert self.static is not None
            return self.static.forward(bucket, batch.token_ids, batch.starts, batch.block_tables, batch.logits_rows,
                                       batch.input_ids)
        layout = plan_layout(batch.block_tables, batch.starts, ends, self.cache.block_size)
        values = dict(layout.values)
        keep, end = batch.logits_row_index()
        if len(keep) != end:  # verify and plain decode steps want every row: no selection instead of a gather
            values["keep"] = (keep, (-1,))
        t = self.upload(values)  # the layout in one host-to-device copy
        meta = layout.metadata(self.cache, t, self.upload)
        # The tokens stay a tensor of their own, as the draft loop's (already on the device) are: a compiled graph
        # specialises on an input's storage offset (0, 1 or more) as on a size, so they must not differ in it.
        input_ids = batch.ids(self.device)  # [1, T]
        self._rows.keep = t.get("keep")
        inputs = dict(input_ids=input_ids, position_ids=meta.positions[None], use_cache=False)
        inputs[attention.METADATA_KWARG] = meta
        try:
            if self.compiled is not None:
                out = self.compiled(compiled=not meta.long, **inputs)  # decode and verify: short queries only
            else:
                out = self.model(**inputs)
        finally:
            self._rows.keep = None
        if self.aux_ids:
            # The early exit shares these layers and fires the hooks too: only the target's own forward is kept.
            self.aux = torch.cat([self._aux_parts[i][0].to(self.device) for i in self.aux_ids], dim=-1)
        # A split model's head is on its last device; sampling and the drafter work on the first.
        return out.logits[0].to(self.device, torch.float32)  # [R, V]

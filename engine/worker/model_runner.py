"""One model and its KV cache, run on packed, paged batches. The target and the draft model each get their own
runner; the early exit (the target's first layers) is a runner over the target's cache."""

from __future__ import annotations

import logging
import threading

import torch

from engine.layers import attention, cpu_attention
from engine.layers.kv_cache import LayerShape, PagedKVCache
from engine.models.early_exit import decoder_layers, truncate
from engine.types.config import DeviceMap
from engine.worker.compiled import CompiledForward, warm_up
from engine.worker.forward_batch import Announcer, ForwardBatch
from engine.worker.graphs import Buckets, StaticForward
from engine.worker.layout import plan_layout
from engine.worker.loading import (
    UnsupportedModelError,
    device_map_kind,
    load_causal_lm,
    probe_layers,
    resolve_device,
    resolve_dtype,
)
from engine.worker.staging import Uploader
from engine.worker.warm_up_layouts import warm_up_blocks, warm_up_layouts

logger = logging.getLogger(__name__)


class RowsToKeep(threading.local):
    """Per thread: the rows of the forward running in it that its LM head takes (None: all)."""

    keep: torch.Tensor | None = None

    def __reduce__(self) -> tuple[type, tuple]:
        # dynamo pickles the objects a graph's guards read (engine.worker.precompile): their type is what counts.
        return type(self), ()


class ModelRunner:
    """A model already built and placed, run on packed, paged batches. ``load`` builds one from a checkpoint;
    benchmarks hand in random models of real sizes (no gigabytes written to disk first)."""

    def __init__(
        self, model: torch.nn.Module, name: str, compile: bool = False, split: bool = False,
        layers: tuple[list[LayerShape], list[torch.device]] | None = None,
    ) -> None:
        """``compile``: decode and verify forwards run through torch.compile (engine.worker.compiled), after
        ``warm_up_compiled``. ``split``: placed across devices by a device map. ``layers``: the K/V shapes and
        devices of the model's layers when known (an early exit's are the target's first ones), else probed."""
        archs = ", ".join(getattr(model.config, "architectures", None) or [type(model).__name__])
        self.dtype = next(model.parameters()).dtype
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
        # attribute read like any other). An early exit shares the target's head: each runner's hook is a no-op
        # while its own runner is not the one running.
        self._rows = RowsToKeep()
        head.register_forward_pre_hook(self._select_rows)
        text_config = self.model.config.get_text_config()
        self.vocab_size: int = text_config.vocab_size
        self.max_position_embeddings: int | None = getattr(text_config, "max_position_embeddings", None)
        attention.register()
        self.layer_shapes, self.layer_devices = layers if layers is not None else probe_layers(model, self.device)
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
        # A target sharded over ranks: rank 0's runner tells the other ranks each forward first (engine.parallel).
        self.leader: Announcer | None = None

    @classmethod
    def load(
        cls, path: str, dtype: str, device: str, trust_remote_code: bool = False, device_map: DeviceMap | None = None,
        compile: bool = False, tensor_parallel: int = 1,
    ) -> ModelRunner:
        """The checkpoint at ``path``; ``device_map`` splits it across devices (``device`` is then unused);
        ``tensor_parallel``: this rank's shard of it (the process group joined first: engine.parallel)."""
        kind = resolve_device(device) if device_map is None else device_map_kind(device_map)
        model = load_causal_lm(path, resolve_dtype(dtype, kind), device, trust_remote_code, device_map,
                               tensor_parallel)
        return cls(model, path, compile=compile, split=device_map is not None)

    @classmethod
    def early_exit(cls, target: ModelRunner, num_layers: int, exit_head: torch.nn.Module | None = None) -> ModelRunner:
        """The target's first ``num_layers`` layers, then its final norm and LM head (or ``exit_head``, a trained
        replacement: engine.models.exit_head), as a runner of its own over the target's own KV cache
        (engine.models.early_exit): its forwards write those layers' K/V exactly where the target's would. Build it
        after the target's ``allocate_cache``."""
        assert target.cache is not None, "allocate the target's cache first"
        model = truncate(target.model, len(target.layer_shapes), num_layers)
        if exit_head is not None:
            head = target.model.get_output_embeddings()
            # truncate gave the short model its own child dict: replacing its head leaves the target's in place
            name = next(n for n, m in model.named_children() if m is head)
            model._modules[name] = exit_head.to(head.weight.device, target.dtype)
        runner = cls(model, f"{target.name} layers [0, {num_layers})", compile=target.compiled is not None,
                     split=target.split, layers=(target.layer_shapes[:num_layers], target.layer_devices[:num_layers]))
        runner.cache = target.cache
        return runner

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
        keep = self._rows.keep
        if keep is None:
            return None
        hidden = args[0]  # [1, T, hidden]
        # index_select: on CPU far cheaper than advanced indexing (~10 ms a call on a 32-sequence bf16 batch).
        return (hidden.index_select(1, keep.to(hidden.device)), *args[1:])

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

    def warm_up_compiled(self, k_max: int, first_block: int = 0) -> float:
        """Compile the layouts decode, verify and draft catch-up steps use (engine.worker.warm_up_layouts), before
        any request runs them. Writes into blocks ``first_block`` on, which nobody may own: unowned ones at
        start-up, or ones kept out of the block manager for a background compile. Returns the seconds it took
        (0 without compile)."""
        if self.compiled is None:
            return 0.0
        assert self.cache is not None
        layouts = warm_up_layouts(k_max, self.cache.block_size, self.cache.num_blocks, first_block)
        seconds = warm_up([lambda b=b: self.forward(b) for b in layouts], self.name)
        self.compiled.frozen = True
        logger.info("compiled the decode and verify forwards of %s in %.1fs", self.name, seconds)
        return seconds

    warm_up_blocks = staticmethod(warm_up_blocks)

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
        if not any(batch.logits_rows) and self._parts_served(batch):
            # Graphs keep at least one row for the LM head: prompt chunks that need no logits (each before its
            # prompt's last) take one each, dropped here, rather than run eagerly.
            return self.forward(batch.with_logits_rows(1))[:0]
        if self.leader is not None:
            self.leader.forward(batch)
        parts = batch.parts() if self._parts_served(batch) else []
        # No graph serves two or more prompt chunks whole; one beside short queries may fit a prompt graph.
        if len(parts) > 2 or (parts and not batch.mixed):
            return self._in_parts(batch, parts)
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
                # Decode and verify forwards, and one prompt chunk where its graphs were loaded (prompt_layouts).
                prompt = bool(meta.long)
                fits = not prompt or (len(meta.long) == 1 and self.compiled.precompiled is not None)
                out = self.compiled(compiled=fits, prompt=prompt, apart=bool(parts), **inputs)
                if out is None:
                    return self._in_parts(batch, parts)
            else:
                out = self.model(**inputs)
        finally:
            self._rows.keep = None
        if self.aux_ids:
            # The early exit shares these layers and fires the hooks too: only the target's own forward is kept.
            self.aux = torch.cat([self._aux_parts[i][0].to(self.device) for i in self.aux_ids], dim=-1)
        # A split model's head is on its last device; sampling and the drafter work on the first.
        return out.logits[0].to(self.device, torch.float32)  # [R, V]

    def _parts_served(self, batch: ForwardBatch) -> bool:
        """Whether a forward of prompt chunks beside short queries can run in parts where no graph serves it whole:
        prompt graphs are loaded (without them a prompt chunk runs eagerly either way), and nothing ties the parts
        together (tokens already on the device, the other ranks or devices of a split model, an EAGLE head's
        hidden states)."""
        c = self.compiled
        return (c is not None and c.precompiled is not None and self.static is None and batch.input_ids is None
                and self.leader is None and not self.split and not self.aux_ids)

    def _in_parts(self, batch: ForwardBatch, parts: list[list[int]]) -> torch.Tensor:
        """``batch`` run as its ``parts`` (ForwardBatch.parts: the short queries in a decode or verify graph, each
        prompt chunk in a prompt graph, or prompts alone as ForwardBatch.apart groups them), its logits rows in
        ``batch``'s order. On 2 CPU cores (the embedded target, prompts of ~120 tokens beside 7-63 sequences
        verifying 0-8 drafts each), one prompt: 31-89 ms eager whole, 25-85 in parts; three: 61-131 against
        61-125."""
        rows: list[torch.Tensor] = [torch.empty(0)] * len(batch.token_ids)
        for part in parts:
            logits = self.forward(batch.part(part)).split([batch.logits_rows[i] for i in part])
            for i, r in zip(part, logits):
                rows[i] = r
        return torch.cat(rows)

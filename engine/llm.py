"""The offline API: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from engine.core.llm_engine import LLMEngine
from engine.types.config import CompileMode, EngineConfig, SpeculativeMethod
from engine.types.outputs import CompletionOutput
from engine.types.sampling_params import SamplingParams
from engine.types.stats import SpecDecodeStats


class LLM:
    """Batched generation with speculative decoding. ``num_speculative_tokens=None`` is adaptive. ``compile``:
    a CompileMode or its value (True: compiled at start-up; "background": generate at once, compiled once
    ready)."""

    def __init__(
        self,
        model: str,
        draft_model: str | None = None,
        draft_layers: int | None = None,
        exit_head: bool = True,
        speculative_method: str | SpeculativeMethod | None = None,
        num_speculative_tokens: int | None = None,
        dtype: str = "auto",
        device: str = "auto",
        device_map: str | dict[str, int | str] | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float = 1.0,
        ngram_max: int = 4,
        seed: int = 0,
        trust_remote_code: bool = False,
        audit_fraction: float = 0.0,
        compile: CompileMode | str | bool = False,
        prefix_caching: bool = True,
        grammar_drafts: bool = True,
        cuda_graphs: bool | None = None,
        paged_attention: str = "auto",
    ) -> None:
        if speculative_method is None:
            speculative_method = SpeculativeMethod.HYBRID if draft_model or draft_layers else SpeculativeMethod.NONE
        self.engine = LLMEngine(
            EngineConfig(
                model=model,
                draft_model=draft_model,
                draft_layers=draft_layers,
                exit_head=exit_head,
                speculative_method=speculative_method,
                num_speculative_tokens=num_speculative_tokens,
                dtype=dtype,
                device=device,
                device_map=device_map,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                kv_cache_memory_gb=kv_cache_memory_gb,
                ngram_max=min(ngram_max, 16),
                seed=seed,
                trust_remote_code=trust_remote_code,
                audit_fraction=audit_fraction,
                compile=compile,
                prefix_caching=prefix_caching,
                grammar_drafts=grammar_drafts,
                cuda_graphs=cuda_graphs,
                paged_attention=paged_attention,
            )
        )
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Seq[int] | Seq[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """All prompts run together in continuous batches; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        plist = list(params) if not isinstance(params, SamplingParams) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        engine = self.engine
        results: dict[str, CompletionOutput] = {}
        order = []
        # Every prompt is tokenized and checked before any is queued.
        prepared = [engine.prepare(prompt, p) for prompt, p in zip(prompts, plist)]
        pending: set[str] = set()
        try:
            for ids, p in zip(prepared, plist):
                rid = f"gen-{next(self._ids)}"
                engine.add_prepared(rid, ids, p)  # may refuse one that can never fit the KV cache
                results[rid] = CompletionOutput(rid, ids)
                order.append(rid)
                pending.add(rid)
            while pending:
                for out in engine.step():
                    if out.request_id in results:
                        results[out.request_id].add(out)
                        if out.finished:
                            pending.discard(out.request_id)
        finally:  # an exception (or Ctrl-C) must not leave requests holding KV blocks
            for rid in pending:
                engine.abort(rid)
        return [results[r] for r in order]

    def stats(self) -> SpecDecodeStats:
        return self.engine.spec_stats

"""The offline API: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

from engine.core.llm_engine import LLMEngine
from engine.types.config import EngineConfig, SpeculativeMethod
from engine.types.outputs import CompletionOutput
from engine.types.sampling_params import SamplingParams
from engine.types.stats import StepTotals


class LLM:
    """Batched generation with speculative decoding: ``LLM(model, **options)``, the options being EngineConfig's
    fields by name (draft_model, speculative_method, num_speculative_tokens, dtype, device, compile, ...; see
    engine.types.config), or ``LLM(EngineConfig(...))``. Without a speculative_method, the method is hybrid when a
    draft_model or draft_layers is given, else none. ``num_speculative_tokens=None`` (the default) is adaptive;
    ``compile`` is off unless asked for (True: compiled at start-up; "background": generate at once, compiled once
    ready)."""

    def __init__(self, model: str | EngineConfig, **options: Any) -> None:
        if isinstance(model, EngineConfig):
            if options:
                raise TypeError(f"LLM(EngineConfig) takes no other options, got {', '.join(sorted(options))}")
            config = model
        else:
            config = engine_config(model, options)
        self.engine = LLMEngine(config)
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

    def stats(self) -> StepTotals:
        return self.engine.spec_stats


def engine_config(model: str, options: Mapping[str, Any]) -> EngineConfig:
    """EngineConfig(model=model, **options), with LLM's two defaults that differ from EngineConfig's own: the method
    follows from what drafts, and the lookup's longest n is capped at 16 like k."""
    known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"LLM() got unknown options {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    values = dict(options)
    if values.get("speculative_method") is None:
        drafts = values.get("draft_model") or values.get("draft_layers")
        values["speculative_method"] = SpeculativeMethod.HYBRID if drafts else SpeculativeMethod.NONE
    if "ngram_max" in values:
        values["ngram_max"] = min(values["ngram_max"], 16)
    return EngineConfig(model=model, **values)

"""The configurations compared: specd (engine LLM) and transformers generate, and what each records."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from engine import LLM, SamplingParams, StepStats
from engine.speculative.ngram import lookup
from engine.worker.model_runner import ModelRunner

from . import BATCH, VERIFY_SIZES
from .timing import engine_forward_fn, hf_forward_fn, interleaved_medians

log = logging.getLogger(__name__)


@dataclass
class Tally:
    """What one configuration did at one batch size, over the measured (not warm-up) runs."""

    rates: list[float] = field(default_factory=list)  # tokens/s, one per repeat
    tokens: int = 0
    seconds: float = 0.0
    steps: list[StepStats] = field(default_factory=list)
    hf_target_calls: int = 0
    hf_draft_calls: int = 0
    outputs: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> tokens (batch 1)
    cs: list[float] = field(default_factory=list)  # c measured once per repeat
    verify: list[list[float]] = field(default_factory=list)  # per repeat: T(n tokens) / T(1), n in VERIFY_SIZES
    last_outputs: list[list[int]] = field(default_factory=list)  # the latest call's generated tokens

    def spec_summary(self) -> dict[str, float] | None:
        """alpha (accepted / drafted), mean accepted length, mean drafts per drafting step (k_draft)
        and per decoding sequence-step (k); None when nothing was drafted or counted."""
        if self.steps:
            drafts = sum(s.num_drafts for s in self.steps)
            draft_tokens = sum(s.num_draft_tokens for s in self.steps)
            accepted = sum(s.num_accepted_tokens for s in self.steps)
            decoding = 0
            for s in self.steps:
                if s.num_draft_tokens and s.mean_k > 0:
                    decoding += round(s.num_draft_tokens / s.mean_k)
                elif s.num_prompt_tokens == 0:
                    decoding += s.num_scheduled
            if not draft_tokens:
                return {"alpha": 0.0, "mean_len": 1.0, "k_draft": 0.0, "k": 0.0}
            return {
                "alpha": accepted / draft_tokens,
                "mean_len": 1.0 + accepted / drafts,
                "k_draft": draft_tokens / drafts,
                "k": draft_tokens / max(decoding, 1),
            }
        if self.hf_target_calls:
            # transformers assisted generation: one target forward per iteration (the first one
            # includes the prompt), one assistant forward per candidate token.
            steps, drafts = self.hf_target_calls, self.hf_draft_calls
            accepted = self.tokens - steps
            return {
                "alpha": accepted / drafts if drafts else 0.0,
                "mean_len": self.tokens / steps,
                "k_draft": drafts / steps,
                "k": drafts / steps,
            }
        return None

    def time_split(self) -> dict[str, float] | None:
        """Shares of wall time in draft forwards, target forwards, the rest of the step, and outside steps."""
        if not self.steps or not self.seconds:
            return None
        draft = sum(s.draft_seconds for s in self.steps)
        target = sum(s.target_seconds for s in self.steps)
        step = sum(s.step_seconds for s in self.steps)
        return {
            "draft": draft / self.seconds,
            "target": target / self.seconds,
            "engine": (step - draft - target) / self.seconds,
            "outside": (self.seconds - step) / self.seconds,
            "steps": len(self.steps),
        }


class Config:
    key: str
    label: str
    batches: tuple[int, ...] = (1, BATCH)
    speculative: bool = True

    def __init__(self) -> None:
        self.tallies: dict[int, Tally] = {b: Tally() for b in self.batches}

    def run(self, prompts: list[list[int]], tally: Tally | None) -> int:
        """Generate for ``prompts`` in one call; record into ``tally`` unless warming up. Returns tokens."""
        raise NotImplementedError

    def measure_c(self, batch: int, ctx: int, reps: int, ngram_context: list[int]) -> float | None:
        """c = T(one draft forward) / T(one target forward); None without a drafter. ``ngram_context``
        is the token list an n-gram drafter's lookup is timed on."""
        return None


class SpecdConfig(Config):
    def __init__(self, key: str, label: str, max_tokens: int, max_model_len: int, **llm_kwargs: object) -> None:
        self.key, self.label = key, label
        self.speculative = llm_kwargs.get("speculative_method") != "none"
        super().__init__()
        self.llm = LLM(
            dtype="float32", device="cpu", max_num_seqs=BATCH, max_model_len=max_model_len, **llm_kwargs
        )  # type: ignore[arg-type]
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine = self.llm.engine
        self._recording: Tally | None = None
        original_step = engine.step

        def recording_step() -> list:
            before = engine.last_step
            out = original_step()
            if self._recording is not None and engine.last_step is not before:
                self._recording.steps.append(engine.last_step)
            return out

        engine.step = recording_step  # type: ignore[method-assign]
        if engine.controller is not None:
            log.info("%s: the goodput controller's step-cost model at start-up: %s", key,
                     engine.controller.cost.parameters())

    def run(self, prompts: list[list[int]], tally: Tally | None) -> int:
        self._recording = tally
        try:
            outs = self.llm.generate(prompts, self.params)
        finally:
            self._recording = None
        if tally is not None:
            tally.last_outputs = [list(o.token_ids) for o in outs]
        return sum(len(o.token_ids) for o in outs)

    def measure_c(self, batch: int, ctx: int, reps: int, ngram_context: list[int]) -> float | None:
        engine = self.llm.engine
        drafter = engine.drafter
        if drafter is None:
            return None
        bs = engine.config.block_size
        target_fn = engine_forward_fn(engine.target, batch, ctx, bs)
        runner = getattr(drafter, "runner", None)
        if isinstance(runner, ModelRunner):
            draft_fn = engine_forward_fn(runner, batch, ctx, bs)
        else:  # n-gram: one lookup per sequence over a realistic (repetitive) token list
            n_max, n_min, k_max = engine.config.ngram_max, engine.config.ngram_min, engine.config.k_max
            toks = (ngram_context * (ctx // max(len(ngram_context), 1) + 1))[:ctx] or [1, 2, 3]

            def draft_fn() -> None:
                for _ in range(batch):
                    lookup(toks, n_max, n_min, k_max)

        t_target, t_draft = interleaved_medians([target_fn, draft_fn], reps)
        return t_draft / t_target

    def measure_verify(self, batch: int, ctx: int, reps: int) -> list[float]:
        """Target forward time with n new tokens per sequence over that with 1, for each n in VERIFY_SIZES."""
        engine = self.llm.engine
        fns = [engine_forward_fn(engine.target, batch, ctx, engine.config.block_size, n) for n in (1, *VERIFY_SIZES)]
        times = interleaved_medians(fns, reps)
        return [t / times[0] for t in times[1:]]


class HFConfig(Config):
    batches = (1,)

    def __init__(self, key: str, label: str, target: torch.nn.Module, draft: torch.nn.Module | None,
                 max_tokens: int, pad_id: int) -> None:
        self.key, self.label = key, label
        self.speculative = draft is not None
        super().__init__()
        self.target, self.draft = target, draft
        self.gen_config = GenerationConfig(
            max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_id
        )
        self._counts = [0, 0]  # target, draft forward calls during the current run
        self._counting = False

        def count(i: int) -> Callable:
            def hook(module: torch.nn.Module, args: object, output: object) -> None:
                if self._counting:
                    self._counts[i] += 1
            return hook

        target.register_forward_hook(count(0))
        if draft is not None:
            draft.register_forward_hook(count(1))

    def run(self, prompts: list[list[int]], tally: Tally | None) -> int:
        assert len(prompts) == 1, "transformers' assisted generation is batch 1 only"
        ids = torch.tensor(prompts, dtype=torch.long)
        self._counts[:] = [0, 0]
        self._counting = True
        try:
            with torch.inference_mode():
                out = self.target.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    generation_config=self.gen_config,
                    assistant_model=self.draft,
                )
        finally:
            self._counting = False
        new = out[0, ids.shape[1]:].tolist()
        if tally is not None:
            tally.last_outputs = [new]
            if self.draft is not None:
                tally.hf_target_calls += self._counts[0]
                tally.hf_draft_calls += self._counts[1]
        return len(new)

    def measure_c(self, batch: int, ctx: int, reps: int, ngram_context: list[int]) -> float | None:
        if self.draft is None:
            return None
        ids = torch.randint(3, 300, (1, ctx), generator=torch.Generator().manual_seed(0))
        ids = ids.clamp(max=self.target.config.get_text_config().vocab_size - 1)
        t_target, t_draft = interleaved_medians([hf_forward_fn(self.target, ids), hf_forward_fn(self.draft, ids)], reps)
        return t_draft / t_target

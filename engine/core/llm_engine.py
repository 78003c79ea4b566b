"""The synchronous engine: add requests, step, get deltas. One step = one target forward."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence as Seq
from dataclasses import fields, replace

import torch

from engine.core import heap
from engine.core.audit import Auditor, is_audit
from engine.core.between_steps import BetweenSteps
from engine.core.loader import load
from engine.core.prompt_scoring import take_prompt_logprobs
from engine.sample import rng
from engine.sample.verifier import Verifier
from engine.sched.block_manager import BlockManager
from engine.sched.scheduler import Scheduler
from engine.sched.stop import StopChecker
from engine.speculative.assemble import make_drafting
from engine.speculative.controller import GoodputController
from engine.speculative.drafting import Drafts
from engine.structured.grammar import GrammarBackend
from engine.structured.healing import heal
from engine.types.config import EngineConfig
from engine.types.errors import SamplingParamError
from engine.types.outputs import RequestOutput, Verdict
from engine.types.sampling_params import SamplingParams
from engine.types.schedule import ScheduledSeq, SchedulerConfig, SchedulerOutput
from engine.types.sequence import FinishReason, Sequence
from engine.types.stats import AuditStats, ForwardCounts, StepStats, StepTotals
from engine.worker.forward_batch import step_batch


def check_text(text: str) -> None:
    """JSON can carry an unpaired surrogate ("\\ud800") that no tokenizer can encode (the fast ones raise TypeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text is not valid Unicode: an unpaired surrogate at character {exc.start}") from None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        loaded = load(config)
        self.target = loaded.target
        self.tokenizer = loaded.tokenizer
        self.eos_ids = loaded.eos_ids
        self.max_model_len = loaded.max_model_len
        self.vocab_size = self.target.vocab_size
        self.device = self.target.device
        self._keys = random.Random(config.seed)  # keys of unseeded requests' random draws
        self.block_manager = BlockManager(loaded.num_blocks, config.block_size, config.prefix_caching)
        limits = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                 config.logit_rows, config.prefill_hold_steps, config.prefill_group_tokens)
        stop = StopChecker(self.eos_ids, self.max_model_len, self.tokenizer)
        self.scheduler = Scheduler(limits, self.block_manager, stop)
        self.drafting = make_drafting(config, loaded.target, loaded.draft, loaded.early_exit, self.eos_ids)
        self.verifier = Verifier(self.eos_ids)
        self.auditor = Auditor(config.audit_fraction)
        self.seqs: dict[str, Sequence] = {}
        self.spec_stats = StepTotals()
        self.audit_stats = AuditStats()
        self.last_step: StepStats | None = None
        self._grammars: GrammarBackend | None = None  # built by the first structured request
        self._grammars_lock = threading.Lock()
        self.compile_mode = loaded.compile_mode  # config.compile as resolved here (AUTO is gone)
        self._compiled = [r.compiled for r in (loaded.target, loaded.draft, loaded.early_exit)
                          if r is not None and getattr(r, "compiled", None) is not None]
        # Started after make_drafting's calibration, whose timed forwards are eager then, as the first steps are;
        # then profiled again in the compile's blocks once the compiled forwards serve, between two steps: timed in
        # the compile's thread beside a request and another process starting (2 CPU cores), it priced 16-64 token
        # decodes and attention per token of context at 2-2.2x the same graphs alone, a slope no step corrects.
        self.between_steps = BetweenSteps()
        if loaded.background is not None and self.drafting is not None and self.drafting.reprofile is not None:
            redo, first, end = self.drafting.reprofile, loaded.num_blocks, self.target.cache.num_blocks
            loaded.background.then(lambda: self.between_steps.add(lambda: redo(first, end)))
        if config.freeze_heap:
            heap.settle()
            for job in (j for j in (loaded.background, loaded.prompts) if j is not None):  # the graphs they load
                job.then(lambda: self.between_steps.add(heap.settle))
        self.prompt_compile = loaded.prompts  # once the decode graphs serve and the profile they queued is done
        if loaded.prompts is not None:
            loaded.prompts.start_after(loaded.background, self.between_steps.add)
        self.background_compile = loaded.background.start() if loaded.background is not None else None

    @property
    def compile_state(self) -> str:
        """off (nothing compiled), compiling (some model still serves eagerly while its warm-up runs, the step-cost
        model is still to be profiled on the compiled forwards, or the prompt graphs compile), compiled, or failed (a
        model's compile failed: it runs eagerly)."""
        threads = [c.thread for c in (self.background_compile, self.prompt_compile) if c is not None]
        # the background compile's thread hands the profile over just before it ends
        taking_over = self.between_steps.pending or any(t.is_alive() for t in threads)
        states = {c.state for c in self._compiled} | ({"compiling"} if taking_over else set())
        return next((s for s in ("compiling", "failed", "compiled") if s in states), "off")

    @property
    def forward_counts(self) -> ForwardCounts:
        c = self._compiled
        return ForwardCounts(**{f.name: sum(getattr(x, f.name) for x in c) for f in fields(ForwardCounts)})

    # ---- requests -------------------------------------------------------------------------------

    def encode(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give the prompt as token ids")
            check_text(prompt)
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def prepare(self, prompt: str | Seq[int], params: SamplingParams) -> list[int]:
        """Tokenize and validate without touching engine state, so a front end can reject a bad
        request (ValueError) before queueing it, from any thread."""
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, but the context (max_model_len) is {self.max_model_len}, "
                             "which leaves no room to generate")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        if params.constraint is not None:
            self.grammars.grammar(params.constraint)  # compiled (and cached) here: a bad one is a 400, not a failure
        if params.token_healing and self.tokenizer is None:
            raise SamplingParamError("token_healing", "needs a tokenizer, and this model has none")
        return ids

    @property
    def grammars(self) -> GrammarBackend:
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("structured output needs a tokenizer, and this model has none")
                self._grammars = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_ids,
                                                parallel=self.device.type != "cpu")
            return self._grammars

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds: no single sequence can ever grow past this."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams) -> None:
        self.add_prepared(request_id, self.prepare(prompt, params), params)

    def add_prepared(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        """Queue token ids that ``prepare`` already checked (a front end validates once, before queueing)."""
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        need = len(ids) + params.max_tokens
        if need > self.kv_capacity_tokens:
            # It would wait (or be preempted) forever: refuse it now.
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) is {need} tokens, more than the "
                f"whole KV cache holds ({self.kv_capacity_tokens} tokens)"
            )
        key = rng.request_key(params.seed, self._keys)
        healing = heal(self.grammars, list(ids)) if params.token_healing else None
        seq = Sequence(request_id, healing.prompt if healing else list(ids), params, arrival_time=time.monotonic(),
                       key=key)
        if params.constraint is not None:
            seq.grammar = self.grammars.start(params.constraint)
        if healing is not None:
            seq.grammar, seq.num_healed_tokens = healing.state, 1
            seq.text.skip = len(healing.text)
        self._add(seq)

    def _add(self, seq: Sequence) -> None:
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. False if it was unknown or already done."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        if self.drafting is not None:
            self.drafting.release(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def has_work(self) -> bool:
        """Whether step() has anything to do: a request, or a job due between steps."""
        return self.between_steps.pending or self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def controller(self) -> GoodputController | None:
        """The goodput controller of adaptive k; None at a fixed k or without speculation."""
        return self.drafting.controller if self.drafting is not None else None

    # ---- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        self.between_steps.run()
        t0 = time.perf_counter()
        if self.drafting is not None:
            self.drafting.plan(self.scheduler.running)
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        t1 = time.perf_counter()
        drafts = (self.drafting.propose(sched.scheduled, self.vocab_size) if self.drafting is not None
                  else Drafts([[] for _ in sched.scheduled], None))
        t2 = time.perf_counter()
        starts = [s.seq.num_computed for s in sched.scheduled]
        logits = self._forward(sched.scheduled, drafts.tokens)  # [R, V]
        logits = take_prompt_logprobs(sched.scheduled, drafts.tokens, logits)  # [R', V]: the sampling rows
        t3 = time.perf_counter()
        verdicts = self._verify(sched, drafts, logits)
        verify_seconds = time.perf_counter() - t3
        num_prompt = sum(s.num_new_tokens for s in sched.scheduled if s.seq.num_computed < s.seq.num_prompt_tokens)
        outputs = self.scheduler.update(sched, verdicts)
        t4 = time.perf_counter()
        if self.drafting is not None:
            self.drafting.absorb(sched.scheduled, starts, drafts.tokens)
        absorb_seconds = time.perf_counter() - t4  # drafting work (an EAGLE head's input), though it runs here
        if self.drafting is not None:
            self.drafting.observe(sched.scheduled, verdicts, drafts.tokens, starts, t3 - t2 + verify_seconds)
        audits = self._finish(outputs)
        outputs = [o for o in outputs if not is_audit(o.request_id)]  # audits are the engine's own work
        grammar_seconds, compiles = self._drain_grammar_costs()
        step = StepStats.of(sched, verdicts, outputs, num_prompt, audits, self.num_running, self.num_waiting,
                            self.block_manager.usage, t2 - t1 + absorb_seconds, t3 - t2, time.perf_counter() - t0,
                            grammar_seconds, compiles)
        if self.drafting is not None:
            self.drafting.observe_step(step.step_seconds)
            decision = self.drafting.decision
            step = replace(step, num_draft_forwards=self.drafting.num_forwards, speculation=decision.mode,
                           predicted_speedup=decision.predicted_speedup)
        self.last_step = step
        self.spec_stats.add(self.last_step)
        return outputs

    def _drain_grammar_costs(self) -> tuple[float, tuple[float, ...]]:
        """Seconds of grammar masks this step, and the compile time of each structured request queued since."""
        backend = self._grammars
        if backend is None:
            return 0.0, ()
        with self._grammars_lock:
            seconds, backend.mask_seconds = backend.mask_seconds, 0.0
            compiles, backend.compile_seconds = tuple(backend.compile_seconds), []
        return seconds, compiles

    def _forward(self, scheduled: list[ScheduledSeq], drafts: list[list[int]]) -> torch.Tensor:
        logits = self.target.forward(step_batch(scheduled, drafts))
        self.target.synchronize()  # so the timings around it mean something
        return logits

    def _verify(self, sched: SchedulerOutput, drafts: Drafts, logits: torch.Tensor) -> list[Verdict | None]:
        """The verdict of each scheduled sequence that samples this step (None for the others)."""
        at = [i for i, s in enumerate(sched.scheduled) if s.samples]
        if not at:
            return [None] * len(sched.scheduled)
        probs = drafts.probs
        if probs is not None and len(at) < probs.shape[0]:
            probs = probs[torch.tensor(at, device=probs.device)]
        got = self.verifier([sched.scheduled[i].seq for i in at], [drafts.tokens[i] for i in at], probs, logits)
        verdicts: list[Verdict | None] = [None] * len(sched.scheduled)
        for i, v in zip(at, got):
            verdicts[i] = v
        return verdicts

    def _finish(self, outputs: list[RequestOutput]) -> tuple[str, ...]:
        """Forget the finished requests; start or judge losslessness audits. Returns the audits judged."""
        judged = []
        for out in outputs:
            if not out.finished:
                continue
            seq = self.seqs.pop(out.request_id)
            if self.drafting is not None:
                self.drafting.release(seq)
            if seq.audit is not None:
                if out.finish_reason != "error":
                    judged.append(self.auditor.judge(seq).value)
            elif (audit := self.auditor.audit_for(seq)) is not None and audit.request_id not in self.seqs:
                self._add(audit)
        self.audit_stats.add(judged)
        return tuple(judged)

"""The synchronous engine: add requests, step, get deltas. One step = one target forward."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.loader import load, make_drafter
from engine.model_runner import ForwardBatch
from engine.outputs import RequestOutput
from engine.rng import RequestRandom
from engine.sampling import logprobs_of, probs_from_logits, process_logits, row_spec
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from engine.sequence import FinishReason, Sequence, TokenLogprob
from engine.spec.adaptive import AdaptivePolicy
from engine.spec.drafter import DraftRequest
from engine.spec.planner import DraftPlanner
from engine.spec.verify import verify, verify_greedy
from engine.stats import SpecDecodeStats, StepStats
from engine.stop import StopChecker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftProbs:
    """The drafter's q for one step: ``probs[rows[request_id]]`` is that sequence's [K_d, V]."""

    probs: torch.Tensor  # [n, K_d, V]
    rows: dict[str, int]


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
        self.rng = RequestRandom(config.seed, self.device)
        self.block_manager = BlockManager(loaded.num_blocks, config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len),
            self.block_manager,
        )
        self.drafter = make_drafter(config, loaded, self.rng)
        self.planner = DraftPlanner(config, self.drafter, loaded) if self.drafter is not None else None
        self.stop = StopChecker(self.eos_ids, self.max_model_len, self.tokenizer)
        self.seqs: dict[str, Sequence] = {}
        self.spec_stats = SpecDecodeStats()
        self.last_step: StepStats | None = None

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
            raise ValueError(
                f"prompt has {len(ids)} tokens, but the context (max_model_len) is {self.max_model_len}, "
                "which leaves no room to generate"
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        return ids

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds: no single sequence can ever grow past this."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams) -> None:
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.prepare(prompt, params)
        need = len(ids) + params.max_tokens
        if need > self.kv_capacity_tokens:
            # It would wait (or be preempted) forever: refuse it now.
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) is {need} tokens, more than the "
                f"whole KV cache holds ({self.kv_capacity_tokens} tokens)"
            )
        seq = Sequence(request_id=request_id, token_ids=ids, params=params, arrival_time=time.monotonic())
        self.rng.add(request_id, params.seed)
        self.seqs[request_id] = seq
        self.stop.add(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. False if it was unknown or already done."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        self._forget(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def _forget(self, seq: Sequence) -> None:
        self.seqs.pop(seq.request_id, None)
        self.rng.remove(seq.request_id)
        self.stop.remove(seq.request_id)
        if self.planner is not None:
            self.planner.forget(seq.request_id)

    # ---- the step -------------------------------------------------------------------------------

    @property
    def policy(self) -> AdaptivePolicy | None:
        """The draft model's adaptive policy (the lookup's without a draft model), None at a fixed k."""
        return self.planner.policy if self.planner is not None else None

    def _draft_lens(self) -> dict[str, int]:
        if self.planner is None:
            return {}
        return self.planner.plan([s for s in self.scheduler.running if s.is_decoding])

    def _propose(self, scheduled: list[ScheduledSeq]) -> tuple[dict[str, list[int]], DraftProbs | None]:
        """Drafts per request id, and the drafter's distributions (rows by request id) if it has them."""
        spec = [s for s in scheduled if s.num_draft_slots > 0]
        if not spec:
            return {}, None
        assert self.drafter is not None and self.planner is not None
        lookup = self.planner.uses_lookup
        proposal = self.drafter.propose([DraftRequest(s.seq, s.num_draft_slots, lookup(s.seq.request_id))
                                         for s in spec])
        drafts = {s.seq.request_id: proposal.tokens[i] for i, s in enumerate(spec)}
        if proposal.probs is None:
            return drafts, None
        return drafts, DraftProbs(proposal.probs, {s.seq.request_id: i for i, s in enumerate(spec)})

    def _forward(self, scheduled: list[ScheduledSeq], drafts: dict[str, list[int]]) -> tuple[torch.Tensor, list[int]]:
        """The step's one target pass: each sequence's uncomputed tokens plus its drafts. Sequences
        that reach their last known token get logits for it and every draft position."""
        feeds, rows = [], []
        for s in scheduled:
            seq = s.seq
            d = drafts.get(seq.request_id, [])
            feeds.append(seq.token_ids[seq.num_computed : seq.num_computed + s.num_new_tokens] + d)
            rows.append(len(d) + 1 if s.samples else 0)
        logits = self.target.forward(
            ForwardBatch(
                token_ids=feeds,
                starts=[s.seq.num_computed for s in scheduled],
                block_tables=[s.seq.block_table for s in scheduled],
                logits_rows=rows,
            )
        )  # [sum(rows), V]
        self.target.synchronize()
        return logits, rows

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        t_step = time.perf_counter()
        sched = self.scheduler.schedule(self._draft_lens())
        if not sched.scheduled:
            return []
        sched_list = sched.scheduled
        t_draft = time.perf_counter()
        drafts, draft_probs = self._propose(sched_list)
        draft_seconds = time.perf_counter() - t_draft
        t_target = time.perf_counter()
        logits, rows = self._forward(sched_list, drafts)
        target_seconds = time.perf_counter() - t_target
        if self.planner is not None:
            self.planner.observe_costs(
                sum(s.num_new_tokens for s in sched_list) + sum(map(len, drafts.values())), target_seconds
            )

        sampling = [s for s, r in zip(sched_list, rows) if r > 0]
        outputs: list[RequestOutput] = []
        if sampling:
            sampling, logits, failed = self._drop_non_finite(sampling, drafts, logits)
            outputs.extend(self._fail(seq, "the target's logits are not finite (NaN or inf)") for seq in failed)
        results = self._verify(sampling, drafts, draft_probs, logits) if sampling else []

        # Prefill work: anything fed below the prompt's end, or a preempted sequence's recomputation.
        num_prompt = sum(s.num_new_tokens for s in sched_list if s.seq.num_computed < s.seq.num_prompt_tokens)
        for s in sched_list:
            if not s.samples:
                s.seq.num_computed += s.num_new_tokens
        pos_counts = [0] * max((len(d) for d in drafts.values()), default=0)
        accepted_lengths, generated, n_drafts, n_draft_tokens, n_accepted = [], 0, 0, 0, 0
        row = 0
        for s, (num_accepted, emitted) in zip(sampling, results):
            seq = s.seq
            k = len(drafts.get(seq.request_id, []))
            seq_logits = logits[row : row + len(emitted)]
            row += k + 1
            if self.planner is not None:
                self.planner.observe(seq.request_id, k, num_accepted, emitted)
            if k:
                n_drafts += 1
                n_draft_tokens += k
                n_accepted += num_accepted
                seq.num_draft_tokens += k
                seq.num_accepted_tokens += num_accepted
                for j in range(num_accepted):
                    pos_counts[j] += 1
                accepted_lengths.append(num_accepted + 1)
            try:
                out = self._append(seq, emitted, seq_logits)
            except Exception:  # e.g. the detokenizer on this sequence's text: fail it, not the whole batch
                logger.exception("request %s failed while appending its tokens", seq.request_id)
                out = self._fail(seq)
            generated += len(out.new_token_ids)
            outputs.append(out)

        decoding = sum(1 for s in sampling if s.seq.request_id in drafts or s.num_new_tokens == 1)
        self.last_step = StepStats(
            num_scheduled=len(sched_list),
            num_prompt_tokens=num_prompt,
            num_generated_tokens=generated,
            num_drafts=n_drafts,
            num_draft_tokens=n_draft_tokens,
            num_accepted_tokens=n_accepted,
            accepted_per_position=tuple(pos_counts),
            accepted_lengths=tuple(accepted_lengths),
            num_decoding=decoding,
            mean_k=n_draft_tokens / decoding if decoding else 0.0,
            num_preempted=len(sched.preempted),
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_usage=self.block_manager.usage,
            draft_seconds=draft_seconds,
            target_seconds=target_seconds,
            step_seconds=time.perf_counter() - t_step,
        )
        self.spec_stats.add(self.last_step)
        return outputs

    def _drop_non_finite(
        self, sampling: list[ScheduledSeq], drafts: dict[str, list[int]], logits: torch.Tensor
    ) -> tuple[list[ScheduledSeq], torch.Tensor, list[Sequence]]:
        """Sequences whose logits rows hold a NaN or +inf (or nothing finite) leave the step, with their
        rows, so that one poisoned sequence cannot feed garbage to verification or stop the others."""
        # amax propagates NaN and +inf, and is -inf only for a row with nothing finite: one reduction, one sync.
        bad = ~torch.isfinite(logits.amax(dim=-1))  # [R]
        if not bool(bad.any()):
            return sampling, logits, []
        bad_rows = bad.tolist()
        keep, keep_rows, failed, row = [], [], [], 0
        for s in sampling:
            n = len(drafts.get(s.seq.request_id, [])) + 1
            if any(bad_rows[row : row + n]):
                failed.append(s.seq)
            else:
                keep.append(s)
                keep_rows.extend(range(row, row + n))
            row += n
        return keep, logits[torch.tensor(keep_rows, dtype=torch.long, device=logits.device)], failed

    def _fail(self, seq: Sequence, why: str | None = None) -> RequestOutput:
        """Finish one sequence with finish_reason "error" (its blocks freed); the rest of the batch goes on."""
        if why is not None:
            logger.error("request %s failed: %s", seq.request_id, why)
        self.scheduler.finish(seq, FinishReason.ERROR)
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[],
            new_text="",
            new_logprobs=[],
            finished=True,
            finish_reason=FinishReason.ERROR.value,
            stop_reason=None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_tokens=seq.num_accepted_tokens,
        )
        self._forget(seq)
        return out

    def _verify(
        self,
        sampling: list[ScheduledSeq],
        drafts: dict[str, list[int]],
        draft_probs: DraftProbs | None,
        logits: torch.Tensor,  # [R, V]
    ) -> list[tuple[int, list[int]]]:
        """Per sampling sequence: (accepted drafts, emitted tokens)."""
        dev = logits.device
        seqs = [s.seq for s in sampling]
        ks = [len(drafts.get(q.request_id, [])) for q in seqs]
        B, K, V = len(seqs), max(ks), logits.shape[-1]
        specs = [
            row_spec(q, drafts.get(q.request_id, [])[:j], self.eos_ids) for q, k in zip(seqs, ks) for j in range(k + 1)
        ]
        processed = process_logits(logits, specs)  # [R, V]
        # Row of (sequence b, position j) in the flat logits; padding positions repeat the last row.
        ks_t = torch.tensor(ks, device=dev)  # [B]
        offsets = (ks_t + 1).cumsum(0) - (ks_t + 1)  # [B] first row of each sequence
        pos = torch.minimum(torch.arange(K + 1, device=dev)[None, :], ks_t[:, None])
        index = offsets[:, None] + pos  # [B, K+1]
        argmax = processed.argmax(-1)[index]  # [B, K+1]
        draft_t = torch.zeros(B, K, dtype=torch.long, device=dev)  # [B, K]
        for b, q in enumerate(seqs):
            if ks[b]:
                draft_t[b, : ks[b]] = torch.tensor(drafts[q.request_id], device=dev)
        num_drafts = ks_t
        if all(q.params.greedy for q in seqs):
            num_acc, tokens = verify_greedy(argmax, draft_t, num_drafts)
        else:
            p = probs_from_logits(processed, [sp.params for sp in specs])[index]  # [B, K+1, V]
            q_probs = None
            if draft_probs is not None:
                # A sequence without drafts may read any row: verify masks every position it has not drafted.
                rows = [draft_probs.rows.get(q.request_id, 0) for q in seqs]
                q_all = draft_probs.probs  # [n, K_d, V]
                q_probs = (q_all if rows == list(range(q_all.shape[0])) else q_all[rows])[:, :K]  # [B, K, V]
            uniforms = torch.ones(B, K, device=dev)  # [B, K]
            noise = torch.ones(B, V, device=dev)  # [B, V]
            for b, q in enumerate(seqs):
                if not q.params.greedy:
                    uniforms[b, : ks[b]] = self.rng.uniforms(q.request_id, ks[b])
                    noise[b] = self.rng.exponentials(q.request_id, 1, V)[0]
            greedy = torch.tensor([q.params.greedy for q in seqs], device=dev)
            num_acc, tokens = verify(p, argmax, draft_t, q_probs, num_drafts, greedy, uniforms, noise)
        num_acc_l, tokens_l = num_acc.tolist(), tokens.tolist()
        return [(a, tokens_l[b][: a + 1]) for b, a in enumerate(num_acc_l)]

    def _append(self, seq: Sequence, emitted: list[int], seq_logits: torch.Tensor) -> RequestOutput:
        """Append verified tokens until a stop condition; set the cache lengths; emit the delta."""
        kept = []
        for token in emitted:
            seq.token_ids.append(token)
            kept.append(token)
            reason = self.stop.check(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                break
        # Every kept token but the last was fed this step (the last known token or an accepted draft),
        # so has valid K/V; K/V written for rejected drafts are forgotten by this length alone.
        seq.num_computed = seq.num_tokens - 1
        seq.draft_num_computed = min(seq.draft_num_computed, seq.num_computed)
        new_logprobs: list[TokenLogprob] = []
        n = seq.params.logprobs
        if n is not None:
            chosen, top_v, top_i = logprobs_of(seq_logits[: len(kept)], torch.tensor(kept, device=seq_logits.device), n)
            for t, lp, tv, ti in zip(kept, chosen.tolist(), top_v.tolist(), top_i.tolist()):
                new_logprobs.append(TokenLogprob(t, lp, tuple(zip(ti, tv))))
            seq.logprobs.extend(new_logprobs)
        text = self.stop.release(seq)
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=kept,
            new_text=text,
            new_logprobs=new_logprobs,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_tokens=seq.num_accepted_tokens,
        )
        if seq.is_finished:
            self._forget(seq)
        return out

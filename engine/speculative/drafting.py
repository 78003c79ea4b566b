"""Per step and per decoding sequence: where its drafts come from and how many; then the drafts
themselves; then what the step taught about each source.

Sources sit behind one Protocol (engine.speculative.source). With two, prompt lookup (free: it is
asked for its proposal while planning) and the draft model, each sequence drafts from the one that
promises more tokens per unit of step cost, each source with its own adaptive policy (their costs and
acceptance differ). Mixing is exact: a lookup's proposal is one-hot, so where a batch needs q, its
rows are one-hot vectors beside the draft model's real distributions, and verification holds row by row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig, SpeculativeMethod
from engine.model_runner import ModelRunner
from engine.outputs import Verdict
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.speculative.adaptive import AdaptivePolicy
from engine.speculative.calibrate import calibrate
from engine.speculative.draft_model import DraftModelSource
from engine.speculative.ngram import LookupSource
from engine.speculative.source import DraftRequest, DraftSource
from engine.structured.forced import FORCED


@dataclass(frozen=True)
class Drafts:
    """One step's drafts, aligned with the scheduled sequences."""

    tokens: list[list[int]]
    probs: torch.Tensor | None  # [S, K, V] q rows where verification needs them (see Proposal)


class Drafting:
    def __init__(self, config: EngineConfig, model: DraftSource | None, lookup: DraftSource | None,
                 policies: dict[str, AdaptivePolicy]) -> None:
        self.config = config
        self.model = model
        self.lookup = lookup
        self.policies = policies  # one per source; empty at a fixed k

    @property
    def policy(self) -> AdaptivePolicy | None:
        """The draft model's adaptive policy (the lookup's without a draft model), None at a fixed k."""
        return next(iter(self.policies.values()), None)

    def plan(self, running: list[Sequence]) -> None:
        """Sets the ``seq.draft`` source, k and lag of each running sequence for this step: none for
        a sequence still prefilling (or recomputing), so no earlier step's plan outlives it."""
        decoding = [s for s in running if s.is_decoding]
        for seq in running:
            d = seq.draft
            d.source, d.k, d.lag, d.lookup, d.forced, d.extend, d.forced_at, d.num_forced = None, 0, 0, [], [], 0, 0, 0
        for seq in decoding:
            d = seq.draft
            source, k = self._route(seq, len(decoding))
            if source is not None:  # with k = 0 too: a lookup shadowing the model still learns from the step
                d.source, d.k, d.lag = source.name, k, source.lag(seq)
                if k and source is not FORCED and seq.grammar is not None and self.config.grammar_drafts:
                    # Room for what the grammar forces after these drafts (a key after a value): certain
                    # once the drafts before them are accepted, so free beside them.
                    d.extend = self.config.k_max
                    d.k += d.extend

    def _route(self, seq: Sequence, batch: int) -> tuple[DraftSource | None, int]:
        k = seq.params.num_speculative_tokens
        if k is None:
            k = self.config.num_speculative_tokens
        if k == 0:
            return None, 0
        d = seq.draft
        if seq.grammar is not None and self.config.grammar_drafts:
            # Tokens the grammar forces are accepted with certainty under the masked target, so they cost
            # only the target's marginal per-token price: take as many as the step allows, before any drafter.
            d.forced = seq.grammar.forced()
            if d.forced:
                return FORCED, min(len(d.forced), k or self.config.k_max)
        if self.lookup is not None:
            d.lookup = self.lookup.propose([DraftRequest(seq, k or self.config.k_max)]).tokens[0]
        if k is not None:  # a fixed k: the lookup wherever it matched (the hybrid's needs n >= 2), else the model
            if d.lookup or self.model is None:
                return self.lookup, min(k, len(d.lookup))
            return self.model, k
        lookup, model = self.policies.get("lookup"), self.policies.get("model")
        if model is None:
            assert lookup is not None
            return self.lookup, lookup.choose(d.track("lookup"), batch, len(d.lookup))
        # Adaptive hybrid: the lookup competes where it matched; each source's own history decides.
        if lookup is not None and d.lookup and (
            lookup.rate(d.track("lookup"), batch, len(d.lookup)) >= model.rate(d.track("model"), batch)
        ):
            return self.lookup, lookup.choose(d.track("lookup"), batch, len(d.lookup))
        return self.model, model.choose(d.track("model"), batch)

    def propose(self, scheduled: list[ScheduledSeq], vocab: int) -> Drafts:
        tokens: list[list[int]] = [[] for _ in scheduled]
        asked, at = [], []
        for i, s in enumerate(scheduled):
            d = s.seq.draft
            own = min(s.num_draft_slots, d.own)
            if d.source == "lookup":
                tokens[i] = d.lookup[:own]
            elif d.source == FORCED.name:
                tokens[i] = d.forced[: s.num_draft_slots]
            elif d.source == "model" and (own or s.num_catch_up):
                asked.append(DraftRequest(s.seq, own, s.num_catch_up))
                at.append(i)
        proposal = self.model.propose(asked) if asked and self.model is not None else None
        if proposal is not None:
            for i, t in zip(at, proposal.tokens):
                tokens[i] = t
        modelled = [0] * len(tokens)  # leading drafts with a real q
        for i in at:
            modelled[i] = len(tokens[i])
        tokens = with_forced(scheduled, grammatical(scheduled, tokens))
        if proposal is None or proposal.probs is None:
            return Drafts(tokens, None)
        probs = proposal.probs.new_zeros(len(scheduled), max(map(len, tokens)), vocab)  # [S, K, V]
        probs[at, : proposal.probs.shape[1]] = proposal.probs[:, : probs.shape[1]]
        for i, t in enumerate(tokens):
            if len(t) > modelled[i]:  # lookup, forced and grammar-extension drafts: one-hot q
                j = torch.arange(modelled[i], len(t))
                probs[i, j] = 0.0
                probs[i, j, torch.tensor(t[modelled[i]:], device=probs.device)] = 1.0
        return Drafts(tokens, probs)

    def observe(self, scheduled: list[ScheduledSeq], verdicts: list[Verdict | None], num_fed: int,
                target_seconds: float) -> None:
        """Costs of this step's forwards, and each sequence's outcome, into the adaptive policies."""
        # The draft model's forward times are drained every step, policy or not.
        draft_times = self.model.drain_costs() if self.model is not None else []
        for policy in self.policies.values():
            policy.target_cost.observe(num_fed, target_seconds)
        if "model" in self.policies:
            for n, secs in draft_times:
                self.policies["model"].draft_cost.observe(n, secs)
        for s, v in zip(scheduled, verdicts):
            d = s.seq.draft
            if v is None or v.error is not None or d.source is None:
                continue
            if d.source == "model" and d.lookup and "lookup" in self.policies:
                # The lookup's proposal scored against what the step emitted: free acceptance evidence
                # (greedy: exactly what it would have had), censored at the emitted length.
                seen = d.lookup[: len(v.tokens)]
                agreed = next((i for i, (a, b) in enumerate(zip(seen, v.tokens)) if a != b), len(seen))
                self.policies["lookup"].observe(d.track("lookup"), len(seen), agreed)
            policy = self.policies.get(d.source)
            own = d.forced_at if d.num_forced else v.num_drafts  # forced drafts teach a source nothing
            if policy is not None and own:
                policy.observe(d.track(d.source), own, min(v.num_accepted, own))


def grammatical(scheduled: list[ScheduledSeq], tokens: list[list[int]]) -> list[list[int]]:
    """Each structured sequence's drafts cut at the first one its grammar forbids: the masked target gives
    that draft probability 0, so it and everything after it would be rejected anyway; cutting spares the
    target their rows (and an EOS draft ends them, since the grammar then allows nothing)."""
    for i, s in enumerate(scheduled):
        grammar = s.seq.grammar
        if grammar is not None and tokens[i]:
            tokens[i] = tokens[i][: grammar.valid_prefix(tokens[i])]
    return tokens


def with_forced(scheduled: list[ScheduledSeq], tokens: list[list[int]]) -> list[list[int]]:
    """Appends to each structured sequence's drafts what its grammar forces after them, into the slots
    kept for it (``DraftState.extend``), and records where the forced drafts are (for the stats and
    so that a source's acceptance is learned from its own drafts only)."""
    for i, s in enumerate(scheduled):
        d, grammar = s.seq.draft, s.seq.grammar
        if d.source == FORCED.name:
            d.forced_at, d.num_forced = 0, len(tokens[i])
        elif grammar is not None and d.extend and tokens[i]:
            room = s.num_draft_slots - len(tokens[i])
            if room > 0:
                grammar.push(tokens[i])
                extra = grammar.forced()[:room]
                grammar.pop(len(tokens[i]))
                d.forced_at, d.num_forced = len(tokens[i]), len(extra)
                tokens[i] = tokens[i] + extra
    return tokens


def make_drafting(config: EngineConfig, target: ModelRunner, draft: ModelRunner | None,
                  eos_ids: tuple[int, ...]) -> Drafting | None:
    if not config.speculates:
        return None
    method = config.speculative_method
    model = DraftModelSource(draft, target.vocab_size, eos_ids) if draft is not None else None
    lookup = None
    if config.uses_lookup:
        # At a fixed k the hybrid has no rates to compare: the lookup takes the step on a suffix match of
        # two or more tokens (a lone token recurs nearly everywhere, and its guesses rarely hold).
        strict = method is SpeculativeMethod.HYBRID and config.num_speculative_tokens is not None
        lookup = LookupSource(config.ngram_max, max(2, config.ngram_min) if strict else config.ngram_min)
    policies = {}
    if config.num_speculative_tokens is None:
        # A draft costs the draft model's forwards, or (runner None) a lookup's near-nothing.
        for source, runner in ((model, draft), (lookup, None)):
            if source is not None:
                policies[source.name] = AdaptivePolicy(config.k_max)
                calibrate(policies[source.name], target, runner, config.block_size)
    return Drafting(config, model, lookup, policies)

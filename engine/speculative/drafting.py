"""Per step and per decoding sequence: where its drafts come from and how many; then the drafts
themselves; then what the step taught about each source.

Sources sit behind one Protocol (engine.speculative.source): the lookups, prompt lookup and suffix decoding
(near free: they are asked for their proposals while planning), the draft model and the target's own early
layers. Each sequence drafts from the one that promises more tokens per unit of step cost, each source with
its own adaptive policy (their costs and acceptance differ). Mixing is exact: a lookup's proposal is one-hot,
so where a batch needs q, its rows are one-hot vectors beside the drafters' real distributions, and
verification holds row by row.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from engine.speculative.adaptive import AdaptivePolicy
from engine.speculative.calibrate import calibrate
from engine.speculative.draft_model import DraftModelSource
from engine.speculative.eagle import EagleRunner, EagleSource
from engine.speculative.forced import FORCED
from engine.speculative.ngram import LookupSource
from engine.speculative.self_draft import SelfDraftSource
from engine.speculative.source import DraftRequest, DraftSource
from engine.speculative.suffix import SuffixSource
from engine.types.config import EngineConfig, SpeculativeMethod
from engine.types.outputs import Verdict
from engine.types.schedule import ScheduledSeq
from engine.types.sequence import Sequence
from engine.types.stats import shares
from engine.worker.model_runner import ModelRunner


@dataclass(frozen=True)
class Drafts:
    """One step's drafts, aligned with the scheduled sequences."""

    tokens: list[list[int]]
    probs: torch.Tensor | None  # [S, K, V] q rows where verification needs them (see Proposal)


class Drafting:
    """``drafters``: the sources that run a model (the draft model, the target's early layers), in order of
    preference at a fixed k; ``lookups``: prompt lookup and suffix decoding, in that order of preference at a
    fixed k, asked while planning since they cost next to nothing."""

    def __init__(self, config: EngineConfig, drafters: list[DraftSource], lookups: list[DraftSource],
                 policies: dict[str, AdaptivePolicy]) -> None:
        self.config = config
        self.drafters = drafters
        self.lookups = lookups
        self.policies = policies  # one per source, by name; empty at a fixed k

    @property
    def lookup(self) -> DraftSource | None:
        """The first lookup source (prompt lookup where it runs)."""
        return self.lookups[0] if self.lookups else None

    def release(self, seq: Sequence) -> None:
        """``seq`` ended (finished, aborted or failed): what a source keeps across requests learns it."""
        for source in self.lookups:
            if isinstance(source, SuffixSource):
                source.release(seq)

    def suffix_cache_nodes(self) -> int:
        """Nodes of suffix decoding's global index (0 without it): its memory, at about 30 bytes a node."""
        return sum(s.cache.num_nodes for s in self.lookups if isinstance(s, SuffixSource))

    @property
    def policy(self) -> AdaptivePolicy | None:
        """The first drafter's adaptive policy (the lookup's without one), None at a fixed k."""
        return next(iter(self.policies.values()), None)

    def source(self, name: str) -> DraftSource | None:
        return next((s for s in (*self.drafters, *self.lookups) if s.name == name), None)

    def plan(self, running: list[Sequence]) -> None:
        """Sets the ``seq.draft`` source, k and lag of each running sequence for this step: none for
        a sequence still prefilling (or recomputing), so no earlier step's plan outlives it."""
        decoding = [s for s in running if s.is_decoding]
        for seq in running:
            d = seq.draft
            d.source, d.k, d.lag, d.lookup, d.forced, d.extend, d.forced_at, d.num_forced = None, 0, 0, [], [], 0, 0, 0
            d.proposals = {}
        for seq in decoding:
            d = seq.draft
            source, k = self._route(seq, len(decoding))
            if source is not None:  # with k = 0 too: a lookup shadowing a drafter still learns from the step
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
        for lookup in self.lookups:
            d.proposals[lookup.name] = lookup.propose([DraftRequest(seq, k or self.config.k_max)]).tokens[0]
        if k is not None:
            # A fixed k: the first lookup that matched (the hybrid's need two tokens of match), else a drafter.
            matched = next((s for s in self.lookups if d.proposals[s.name]), None)
            if matched is None and not self.drafters:
                matched = self.lookups[0]
            if matched is not None:
                d.lookup = d.proposals[matched.name]
                return matched, min(k, len(d.lookup))
            return self.drafters[0], k
        # Adaptive: each source's own history and cost decide. A lookup competes where it proposed something,
        # its k capped by its proposal's length: prompt lookup's and suffix decoding's acceptance are learned
        # per sequence apart, so a request that repeats earlier outputs goes to suffix decoding, one that
        # quotes its own prompt to whichever of the two has been right there, one with nothing to match to
        # a model drafter.
        best, rate, cap = None, -1.0, None
        for drafter in self.drafters:
            r = self.policies[drafter.name].rate(d.track(drafter.name), batch)
            if r > rate:
                best, rate = drafter, r
        for lookup in self.lookups:
            n = len(d.proposals[lookup.name])
            if n or (best is None and lookup is self.lookups[-1]):
                r = self.policies[lookup.name].rate(d.track(lookup.name), batch, n)
                if best is None or r > rate or (r == rate and best in self.drafters):
                    best, rate, cap = lookup, r, n
        assert best is not None
        if cap is not None:
            d.lookup = d.proposals[best.name]
        return best, self.policies[best.name].choose(d.track(best.name), batch, cap)

    def propose(self, scheduled: list[ScheduledSeq], vocab: int) -> Drafts:
        tokens: list[list[int]] = [[] for _ in scheduled]
        asked: dict[str, tuple[list[DraftRequest], list[int]]] = {s.name: ([], []) for s in self.drafters}
        for i, s in enumerate(scheduled):
            d = s.seq.draft
            own = min(s.num_draft_slots, d.own)
            if d.source in d.proposals:
                tokens[i] = d.proposals[d.source][:own]
            elif d.source == FORCED.name:
                tokens[i] = d.forced[: s.num_draft_slots]
            elif d.source in asked and (own or s.num_catch_up):
                asked[d.source][0].append(DraftRequest(s.seq, own, s.num_catch_up))
                asked[d.source][1].append(i)
        proposals = []  # (rows, proposal) of each drafter asked
        for drafter in self.drafters:
            requests, at = asked[drafter.name]
            if requests:
                proposal = drafter.propose(requests)
                proposals.append((at, proposal))
                for i, t in zip(at, proposal.tokens):
                    tokens[i] = t
        modelled = [0] * len(tokens)  # leading drafts with a real q
        for at, _ in proposals:
            for i in at:
                modelled[i] = len(tokens[i])
        tokens = with_forced(scheduled, grammatical(scheduled, tokens))
        with_q = [(at, p.probs) for at, p in proposals if p.probs is not None]
        if not with_q:
            return Drafts(tokens, None)
        first = with_q[0][1]
        probs = first.new_zeros(len(scheduled), max(map(len, tokens)), vocab)  # [S, K, V]
        for at, q in with_q:
            probs[at, : q.shape[1]] = q[:, : probs.shape[1]]
        for i, t in enumerate(tokens):
            if len(t) > modelled[i]:  # lookup, forced and grammar-extension drafts: one-hot q
                j = torch.arange(modelled[i], len(t))
                probs[i, j] = 0.0
                probs[i, j, torch.tensor(t[modelled[i]:], device=probs.device)] = 1.0
        return Drafts(tokens, probs)

    def absorb(self, scheduled: list[ScheduledSeq], starts: list[int], drafts: list[list[int]]) -> None:
        """After the target's forward and the scheduler's update: drafters that read the target's hidden states
        (EAGLE heads) take those of the positions each sequence kept. ``starts``: num_computed before the step."""
        for drafter in self.drafters:  # at most one: a draft model or a head
            if isinstance(drafter, EagleSource):
                drafter.absorb(scheduled, starts, [s.num_new_tokens + len(d) for s, d in zip(scheduled, drafts)])

    def observe(self, scheduled: list[ScheduledSeq], verdicts: list[Verdict | None], num_fed: int,
                target_seconds: float) -> None:
        """Costs of this step's forwards, and each sequence's outcome, into the adaptive policies."""
        for policy in self.policies.values():
            policy.target_cost.observe(num_fed, target_seconds)
        for drafter in self.drafters:
            # Drained every step, policy or not.
            for n, secs in drafter.drain_costs():
                if drafter.name in self.policies:
                    self.policies[drafter.name].draft_cost.observe(n, secs)
        for s, v in zip(scheduled, verdicts):
            d = s.seq.draft
            if v is None or v.error is not None or d.source is None:
                continue
            for name, proposal in d.proposals.items():
                lookup = self.policies.get(name)
                if lookup is not None and proposal and d.source in self.policies and d.source != name:
                    # A lookup's proposal scored against what the step emitted: free acceptance evidence
                    # (greedy: exactly what it would have had), censored at the emitted length.
                    seen = proposal[: len(v.tokens)]
                    agreed = next((i for i, (a, b) in enumerate(zip(seen, v.tokens)) if a != b), len(seen))
                    lookup.observe(d.track(name), len(seen), agreed)
            policy = self.policies.get(d.source)
            if policy is not None:  # from its own drafts only: forced ones teach a source nothing
                for share in shares(d, v.num_drafts, v.num_accepted):
                    if share.source == d.source:
                        policy.observe(d.track(d.source), share.drafted, share.accepted)


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


def make_drafting(config: EngineConfig, target: ModelRunner, draft: ModelRunner | EagleRunner | None,
                  early_exit: ModelRunner | None, eos_ids: tuple[int, ...]) -> Drafting | None:
    """``draft``: the draft model's runner or an EAGLE head's; ``early_exit``: the target's first layers
    (self-speculation)."""
    if not config.speculates:
        return None
    method = config.speculative_method
    drafters: list[tuple[DraftSource, ModelRunner | EagleRunner | None]] = []
    if isinstance(draft, EagleRunner):
        drafters.append((EagleSource(draft, target, eos_ids), draft))
    elif draft is not None:
        drafters.append((DraftModelSource(draft, target.vocab_size, eos_ids), draft))
    if early_exit is not None:
        drafters.append((SelfDraftSource(early_exit, target.vocab_size, eos_ids), early_exit))
    lookups: list[DraftSource] = []
    # At a fixed k the hybrid has no rates to compare: a lookup takes the step on a suffix match of two or
    # more tokens (a lone token recurs nearly everywhere, and its guesses rarely hold).
    strict = method is SpeculativeMethod.HYBRID and config.num_speculative_tokens is not None
    if config.uses_lookup:
        lookups.append(LookupSource(config.ngram_max, max(2, config.ngram_min) if strict else config.ngram_min))
    if config.uses_suffix:
        lookups.append(SuffixSource(config.suffix_cache_requests, config.suffix_max_draft, 2 if strict else 1))
    policies: dict[str, AdaptivePolicy] = {}
    if config.num_speculative_tokens is None:
        # A draft costs its runner's forwards, or (runner None) a lookup's near-nothing.
        for source, runner in drafters:
            policies[source.name] = AdaptivePolicy(config.k_max)
            calibrate(policies[source.name], target, runner, config.block_size, source.name)
        for source in lookups:
            # The lookups cost the same (nothing but the target's marginal price): one calibration, copied, so
            # that they differ by their acceptance alone, never by the noise of two timings.
            policies[source.name] = AdaptivePolicy(config.k_max)
            if source is lookups[0]:
                calibrate(policies[source.name], target, None, config.block_size, source.name)
            else:
                first = policies[lookups[0].name]
                policies[source.name].target_cost = copy.deepcopy(first.target_cost)
                policies[source.name].draft_cost = copy.deepcopy(first.draft_cost)
    return Drafting(config, [source for source, _ in drafters], lookups, policies)

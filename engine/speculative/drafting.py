"""Per step and per decoding sequence: where its drafts come from and how many, the drafts, what the step taught.

Sources sit behind one Protocol (engine.speculative.source): the lookups, prompt lookup and suffix decoding
(cheap: asked for their proposals while planning, when the plan may use them), the draft model and the
target's own early layers. With adaptive k the goodput controller (engine.speculative.controller) picks each
sequence's source and k for the whole batch at once; at a fixed k a matching lookup drafts, else the first
drafter. Mixing is exact: a lookup's proposal is one-hot, so where a batch needs q, its rows are one-hot
vectors beside the drafters' real distributions, and verification holds row by row.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.layers.attention_metadata import SHORT_QUERY
from engine.speculative.asking import index_new, worth_asking
from engine.speculative.controller import Decision, GoodputController
from engine.speculative.eagle import EagleSource
from engine.speculative.forced import FORCED, grammatical, with_forced
from engine.speculative.source import DraftRequest, DraftSource
from engine.speculative.suffix import SuffixSource
from engine.types.config import EngineConfig
from engine.types.outputs import Verdict
from engine.types.schedule import ScheduledSeq
from engine.types.sequence import Sequence
from engine.types.stats import shares

FADE = 0.95  # what a model drafter's estimate for a sequence keeps of its evidence per step it sits out


@dataclass(frozen=True)
class Drafts:
    """One step's drafts, aligned with the scheduled sequences."""

    tokens: list[list[int]]
    probs: torch.Tensor | None  # [S, K, V] q rows where verification needs them (see Proposal)


class Drafting:
    """``drafters``: the sources that run a model (the draft model, the target's early layers), in order of
    preference at a fixed k; ``lookups``: prompt lookup and suffix decoding, in that order of preference at a
    fixed k. ``controller``: the goodput controller of adaptive k, None at a fixed k."""

    def __init__(self, config: EngineConfig, drafters: list[DraftSource], lookups: list[DraftSource],
                 controller: GoodputController | None) -> None:
        self.config = config
        self.drafters = drafters
        self.lookups = lookups
        self.controller = controller
        self.num_forwards = 0  # the drafters' forwards in the last observed step
        self.decision = Decision(mode="")  # the controller's, for the step planned last
        self._lookup_seconds = 0.0
        self._pending: tuple[Counter[str], int, float] | None = None  # (speculating by source, scheduled, timed s)
        self._dirty = True  # whether a sequence's draft state may hold this step's plan (reset before the next)
        self._unfaded = 0  # plain steps whose fading of the model drafters' estimates is still to be applied
        # Profiles the step-cost model again, into blocks [first, end) nobody owns: once compiled forwards took over
        self.reprofile: Callable[[int, int], None] | None = None

    @property
    def lookup(self) -> DraftSource | None:  # the first lookup source (prompt lookup where it runs)
        return self.lookups[0] if self.lookups else None

    def release(self, seq: Sequence) -> None:
        """``seq`` ended (finished, aborted or failed): what a source keeps across requests learns it."""
        for source in self.lookups:
            if isinstance(source, SuffixSource):
                source.release(seq)
        if self.controller is not None:  # and how long requests run
            self.controller.finished(seq.num_output_tokens)

    def suffix_cache_nodes(self) -> int:
        """Nodes of suffix decoding's global index (0 without it): its memory, at about 65 bytes a node."""
        return sum(s.cache.num_nodes for s in self.lookups if isinstance(s, SuffixSource))

    def source(self, name: str) -> DraftSource | None:
        return next((s for s in (*self.drafters, *self.lookups) if s.name == name), None)

    def plan(self, running: list[Sequence]) -> None:
        """Sets the ``seq.draft`` source, k and lag of each running sequence for this step: none for
        a sequence still prefilling (or recomputing), so no earlier step's plan outlives it."""
        decoding = [s for s in running if s.is_decoding]
        if self._dirty:  # after a plain step every field is still at its reset value: nothing to reset
            for seq in running:
                seq.draft.clear_plan()
            self._dirty = False
        self._lookup_seconds = 0.0
        adaptive = [False] * len(decoding)
        for i, seq in enumerate(decoding):
            source, k = self._route(seq)
            if k < 0:
                adaptive[i] = True
            elif source is not None:  # with k = 0 too: a lookup shadowing a drafter still learns from the step
                self._assign(seq, source, k, source.lag(seq))
        self.decision = Decision(mode="")
        if self.controller is not None and any(adaptive):
            self._plan_adaptive(decoding, adaptive)
            self.decision = self.controller.decision

    def _assign(self, seq: Sequence, source: DraftSource, k: int, lag: int) -> None:
        self._dirty = True
        d = seq.draft
        d.source, d.k, d.lag = source.name, k, lag
        if source.name in d.proposals:
            d.lookup = d.proposals[source.name]
        if k and source is not FORCED and seq.grammar is not None and self.config.grammar_drafts:
            # Room for what the grammar forces after these drafts (a key after a value): certain once the drafts
            # before them are accepted, so free beside them; within a short query (a lookup's k may pass k_max).
            d.extend = max(0, min(self.config.k_max, SHORT_QUERY - 1 - k))
            d.k += d.extend

    def _plan_adaptive(self, seqs: list[Sequence], adaptive: list[bool]) -> None:
        """The goodput controller's plan for the sequences on the adaptive path (engine.speculative.controller)."""
        c = self.controller
        assert c is not None
        if c.still_plain(len(seqs), any(not seq.draft.tracks for seq in seqs)):  # no tracks: never planned for
            return
        t_plan = time.perf_counter()
        self._fade(seqs)
        on = np.array(adaptive)
        lags = {s.name: np.array([s.lag(seq) if a else 0 for seq, a in zip(seqs, adaptive)]) for s in self.drafters}
        plan = None if c.asks_again() else c.before_lookups(seqs, on, lags)
        asked = plan is None or c.wants_lookups(plan)
        if asked or plan is None:
            asking = worth_asking([seq for seq, a in zip(seqs, adaptive) if a], c.lookups, plan is None)
            self._dirty = True
            t0, cap = time.perf_counter(), c.lookup_cap(len(seqs))
            indexing = index_new(asking, self.lookups)  # once a request: not a price of asking
            for lookup in self.lookups:
                proposal = lookup.propose([DraftRequest(seq, cap) for seq in asking])
                for seq, tokens in zip(asking, proposal.tokens):
                    seq.draft.proposals[lookup.name] = tokens
            self._lookup_seconds = time.perf_counter() - t0
            c.cost.lookup.observe(len(asking), self._lookup_seconds - indexing)
            plan = (c.again(seqs) if plan is None else None) or c.with_proposals(seqs, on, lags)
        c.decide(plan, asked)
        c.observe_use(plan, on, lags)
        if not plan.speculates and not asked:  # a speculating step's planning is priced with its other host work
            c.observe_planning(len(seqs), time.perf_counter() - t_plan)
        for i, (seq, (name, k)) in enumerate(zip(seqs, plan.choices)):
            source = self.source(name) if name is not None and k else None
            if adaptive[i] and source is not None:
                self._assign(seq, source, k, int(lags[name][i]) if name in lags else 0)

    def _route(self, seq: Sequence) -> tuple[DraftSource | None, int]:
        """The source and k of a sequence whose k is fixed (by the request or the server) or forced by its grammar;
        k = -1 for the adaptive path, which the controller plans for the whole batch."""
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
            self._dirty = True
            if d.forced:
                return FORCED, min(len(d.forced), k or self.config.k_max)
        if k is None:
            return None, -1
        self._dirty = True
        for lookup in self.lookups:
            d.proposals[lookup.name] = lookup.propose([DraftRequest(seq, k)]).tokens[0]
        # A fixed k: the first lookup that matched (the hybrid's need two tokens of match), else a drafter.
        matched = next((s for s in self.lookups if d.proposals[s.name]), None)
        if matched is None and not self.drafters:
            matched = self.lookups[0]
        if matched is not None:
            return matched, min(k, len(d.proposals[matched.name]))
        return self.drafters[0], k

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
        modelled = [0] * len(tokens)  # leading drafts with a real q
        for drafter in self.drafters:
            requests, at = asked[drafter.name]
            if requests:
                proposal = drafter.propose(requests)
                proposals.append((at, proposal))
                for i, t in zip(at, proposal.tokens):
                    tokens[i], modelled[i] = t, len(t)
        tokens = with_forced(scheduled, grammatical(scheduled, tokens))
        with_q = [(at, p.probs) for at, p in proposals if p.probs is not None]
        if not with_q:
            return Drafts(tokens, None)
        probs = with_q[0][1].new_zeros(len(scheduled), max(map(len, tokens)), vocab)  # [S, K, V]
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

    def _fade(self, seqs: list[Sequence]) -> None:
        """The fading of the plain steps since the last pass, on ``seqs``' model-drafter estimates."""
        if not self._unfaded:
            return
        factor, self._unfaded = FADE**self._unfaded, 0
        for seq in seqs:
            tracks = seq.draft.tracks
            for drafter in self.drafters:
                track = tracks.get(drafter.name)
                if track is not None and track.alpha is not None:
                    track.alpha.fade(factor)

    def observe_step(self, step_seconds: float) -> None:
        """The whole step's time: what it spent outside the target, the drafters' forwards and the lookups is host
        work (planning, bookkeeping, verification's and the scheduler's per-token work). A plain step's teaches
        the controller what that costs anyway; a speculative step's, what speculating adds to it."""
        c, pending, self._pending = self.controller, self._pending, None
        if c is None or pending is None:
            return
        speculating, num_seqs, timed = pending
        other = max(0.0, step_seconds - timed - self._lookup_seconds)
        if speculating:
            c.cost.host.observe(speculating, max(0.0, other - c.cost.host_plain(num_seqs)))
        else:
            c.cost.host_plain.observe(num_seqs, other)

    def observe(self, scheduled: list[ScheduledSeq], verdicts: list[Verdict | None], drafts: list[list[int]],
                starts: list[int], target_seconds: float) -> None:
        """Costs of this step's parts, and each sequence's outcome, into the goodput controller. ``starts``:
        num_computed before the step; ``target_seconds``: the target's forward and the verification."""
        forward_seconds, self.num_forwards = 0.0, 0
        c = self.controller
        for drafter in self.drafters:
            for n, secs, long in drafter.drain_costs():  # drained every step, controller or not
                forward_seconds += secs
                self.num_forwards += 1
                if c is not None:
                    (c.cost.catch_ups if long else c.cost.drafters)[drafter.name].observe(n, secs)
        if c is None:
            return
        if all(s.num_new_tokens == 1 for s in scheduled):
            # Decode and verify steps only: a prompt chunk's forward (every other step under load) is one no plan
            # prices, and it pulled the profile's largest sizes toward it (a 64-sequence verify looked 30% cheaper).
            fed = [1 + len(d) for d in drafts]
            context = sum(n * (start + n) for n, start in zip(fed, starts)) / 1000.0
            c.cost.target.observe(sum(fed), context, target_seconds, max(fed, default=0) > 1)
        # The rest of the step is known once it ends (observe_step): kept until then.
        speculating = Counter(s.seq.draft.source or "" for s, d in zip(scheduled, drafts) if d)
        self._pending = (speculating, len(scheduled), target_seconds + forward_seconds)
        if not self._dirty:
            # A plain step: no source drafted or proposed, so each sequence's only news is that the model drafters
            # sat it out. Their estimates fade once per such step; applied together when next read (_fade), since
            # a pass over the batch every step was a plain step's largest host cost beside the forward.
            self._unfaded += 1
            return
        self._fade([s.seq for s in scheduled])
        for s, v in zip(scheduled, verdicts):
            d = s.seq.draft
            if v is None or v.error is not None:
                continue
            for name, proposal in d.proposals.items():
                if proposal and d.source != name and name in c.acceptance:
                    # A lookup's proposal scored against what the step emitted: free acceptance evidence, censored
                    # at the emitted length (greedy: exactly what it would have had; sampled: a one-hot draft x is
                    # accepted with probability p(x), the chance the target emits x).
                    seen = proposal[: len(v.tokens)]
                    agreed = next((i for i, (a, b) in enumerate(zip(seen, v.tokens)) if a != b), len(seen))
                    c.acceptance[name].observe(d.track(name), len(seen), agreed)
            for drafter in self.drafters:
                track = d.tracks.get(drafter.name)
                if track is not None and track.alpha is not None and drafter.name != d.source:
                    # A model drafter sitting out has no evidence on this sequence but old: its estimate drifts
                    # back to the source's rate, so one bad stretch does not keep it out for the request's life.
                    track.alpha.fade(FADE)
            if d.source in c.acceptance:  # from its own drafts only: forced ones teach a source nothing
                for share in shares(d, v.num_drafts, v.num_accepted):
                    if share.source == d.source:
                        c.acceptance[d.source].observe(d.track(d.source), share.drafted, share.accepted)


"""The goodput controller: every step, for each decoding sequence on the adaptive path, which source drafts and
how many tokens, priced by the step-cost model against each source's acceptance (engine.speculative.goodput
finds the best plan). It replaces fixed thresholds: speculation turns down, then off, exactly where the
measured cost of a draft outweighs what it is expected to bring, and that point moves with the host, the
forward in use and the batch.

A plan is made twice, so that a step that will not speculate does no speculative work at all. First from what is
known before any lookup is asked (each lookup's chance of proposing anything, what asking costs): if that plan is
the plain step, no lookup is asked and no drafter runs. Otherwise the lookups are asked and the plan is made again
from their real proposals. While speculation stays off, the lookups are still asked (a probe), so that a request
turning repetitive is noticed (their proposals are scored against what the step emits: evidence at the price of a
lookup): as often as asking for the whole batch costs at most ``probe_budget`` of the plain steps in between (on 2
CPU cores every 50 steps at 64 sequences, every 4 at one), and no more often than every ``probe_interval``. A floor
of 16 steps cost batch 1 a tenth on code ending in a newline (1.28x against 1.46x of no speculation; at 32 random
tokens 0.96x against 1.01x: benchmarks/controller_ab.py, results/probe_floor.json); spaced by their whole host time
instead, probes came less often and agentic conversations at 64 ran 5-10% slower: a probe is worth what it finds.
A plain decision is planned again every ``replan_interval`` steps, less often where that planning costs more than
``probe_budget`` of the plain steps between. A speculating step's asks are in no price (about 0.8 ms for 32
sequences on 2 CPU cores); priced into every speculating plan, the server ran at 0.86x-1.09x of without (median
0.955x) over code ending in a newline and random tokens at 1-64 concurrent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from engine.layers.attention_metadata import SHORT_QUERY
from engine.speculative.adaptive import SourceAcceptance
from engine.speculative.goodput import Block, Plan, solve, solve_one
from engine.speculative.goodput import plain as plain_plan
from engine.speculative.step_cost import LinearCost, StepCostModel
from engine.types.draft_state import SourceTrack
from engine.types.sequence import Sequence

PLAIN, PROBE, SPECULATE = "plain", "probe", "speculate"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """What the controller chose for the step, for the stats: its mode, the speedup it predicted over the
    plain step, and the drafts it planned."""

    mode: str = PLAIN
    predicted_speedup: float = 1.0
    planned_drafts: int = 0


def expected_drafts(plan: Plan, blocks: list[Block]) -> float:
    """The drafts ``plan`` feeds, each sequence's weighted by the chance its source drafts at all."""
    chance = {b.source: np.broadcast_to(np.asarray(b.chance, dtype=float), (len(plan.choices),)) for b in blocks}
    return float(sum(k * chance[src][i] for i, (src, k) in enumerate(plan.choices) if k))


class GoodputController:
    def __init__(self, k_max: int, drafters: list[str], lookups: list[str], margin: float = 0.02,
                 probe_interval: int = 1, replan_interval: int = 8, probe_budget: float = 0.01,
                 lookup_k_max: int = 0, rows: int = 0) -> None:
        self.k_max, self.lookup_k_max = k_max, max(k_max, lookup_k_max)  # a model drafter's and a lookup's most drafts
        self.rows = rows  # the most rows a step's verify may feed (its logits: the memory plan's), 0: no bound
        self.drafters = drafters  # the sources that run a forward per draft position, in order
        self.lookups = lookups
        self.cost = StepCostModel(drafters)
        self.acceptance = {name: SourceAcceptance(self.lookup_k_max if name in lookups else k_max,
                                                  explore=0.5 if name in drafters else 0.0)
                           for name in (*drafters, *lookups)}
        # The plan must beat the plain step by this much: the model's own error should not turn into a loss.
        self.margin = margin
        self.probe_interval = probe_interval
        self.probe_budget = probe_budget
        self.replan_interval = replan_interval
        self._interval = probe_interval  # steps between probes, for the batch last planned
        self._since_asked = 0
        self._planned_for, self._since_planned = -1, 0  # the batch the last plan was for, and steps since
        self._plain_seconds = 0.0  # the last plan's plain step
        self.planning = LinearCost()  # the host time of planning a plain step again, by sequences (Drafting times it)
        self._per_token = np.zeros(0)  # [S]: one more token's attention to each sequence's context, this step
        self._drafts = 0  # drafts the last speculating plan fed: where the target's cost is linearised next
        self._turn = False
        self._typical: float | None = None  # output tokens of the recent finished requests (moving average)
        # Per model drafter: the share of the sequences it could draft for from a current cache (lag within a short
        # query) that plans gave it, recently (a moving average over planned steps; half until seen).
        self._use = dict.fromkeys(drafters, 0.5)
        self.decision = Decision()
        self._last: tuple[dict[str, tuple[str | None, int]], Plan] | None = None  # from real proposals, by request
        self._reused = False  # whether the step planned last took it again (``again``)

    def before_lookups(self, seqs: list[Sequence], adaptive: np.ndarray, lags: dict[str, np.ndarray]) -> Plan:
        """The plan from what is known before asking the lookups, whose proposals are priced at each track's
        share of asks that found one, at the cost of asking. ``adaptive`` [S]: the sequences planned for;
        ``lags``: each model drafter's catch-up [S]."""
        look_a, look_b = self.cost.lookup.coefficients()
        blocks = self._drafter_blocks(seqs, adaptive, lags)
        caps = np.where(adaptive, self.lookup_cap(len(seqs)), 0)
        for name in self.lookups:
            tracks = [seq.draft.track(name) for seq in seqs]
            scale = np.array([t.proposes for t in tracks])
            blocks.append(self._block(name, tracks, caps, scale, look_b))
        return self._solve(seqs, blocks, look_a if self.lookups else 0.0)

    def lookup_cap(self, num_seqs: int) -> int:
        """The most drafts a lookup may give one of ``num_seqs`` sequences: k_max, and past it a share of one
        sequence's reach to ``lookup_k_max`` (the rows a step spends past k_max stay one long draft's, shared),
        within ``rows``. A lookup's drafts cost no forward, and a copying request's hold long: with hindsight they
        bound agentic turns alone at 3.02x within 8 drafts, 3.89x within 24 (benchmarks/draft_oracle.py). At 8 in
        flight, each reaching 24 ran at 0.91x of 8: a row is dearer beside a plain token's share of the step."""
        n = max(1, num_seqs)
        reach = self.k_max + (self.lookup_k_max - self.k_max) // n
        return max(self.k_max, min(reach, self.rows // n - 1 if self.rows else reach))

    def still_plain(self, num_seqs: int, fresh: bool = False) -> bool:
        """Whether the last plain decision stands for this step without planning again: no probe due, planned
        fewer than ``replan_interval`` steps ago (more where planning costs more than ``probe_budget`` of the
        plain steps between), and no ``fresh`` sequence (one never planned for: a new request may repeat its
        prompt from its first token, and its lookups are asked at once). Planning costs host time (a tenth of a
        compiled decode step of a small model). A batch that only lost requests keeps the decision."""
        replan = max(self.replan_interval, self._spacing(self.planning, num_seqs))
        if (self.decision.mode == SPECULATE or fresh or self._planned_for < 0 or self._since_planned + 1 >= replan
                or self._since_asked + 1 >= self._interval):
            return False
        self._since_planned += 1
        self._since_asked += 1
        self.decision = Decision(PLAIN, 1.0, 0)
        return True

    def asks_again(self) -> bool:
        """Whether the lookups are asked this step without a plan from expectations first: the last step
        speculated, so a first plan would most likely speculate too and be remade from the real proposals (two
        solves of the batch where one does)."""
        if self.decision.mode != SPECULATE or not self.lookups:
            return False
        self._since_asked = 0
        return True

    def wants_lookups(self, plan: Plan) -> bool:
        """Whether to ask the lookups this step: the first plan speculates (asking is cheap beside a speculative
        step, and a real proposal may beat what was expected), or a probe is due."""
        self._since_asked += 1
        asking = self.cost.lookup(len(plan.choices))
        self._interval = max(self.probe_interval, int(asking / (self.probe_budget * max(plan.plain_seconds, 1e-9))))
        if plan.speculates or self._since_asked >= self._interval:
            self._since_asked = 0
            return bool(self.lookups)
        return False

    def again(self, seqs: list[Sequence]) -> Plan | None:
        """The last plan made from real proposals once more, the step after it speculated, where that plan was not
        itself taken again: each sequence it planned for keeps its source and k, a lookup's k cut to what it
        proposes now (nothing: no drafts); one that joined since drafts nothing until the next step plans. None
        where the plan must be made (``with_proposals``). Made every speculating step, the plan cost 15% of a
        9.7 ms step at 8 sequences on 2 CPU cores (the solver 0.46 ms, the sources' options 0.6); a step later,
        the batch, its acceptance and the cost model have moved by one step's evidence."""
        last = self._last
        if self._reused or last is None or self.decision.mode != SPECULATE or last[1].speedup <= 1.0 + self.margin:
            self._reused = False
            return None
        choices = []
        for seq in seqs:
            name, k = last[0].get(seq.request_id, (None, 0))
            if name in self.lookups:
                k = min(k, len(seq.draft.proposals.get(name, ())))
            choices.append((name, k) if k else (None, 0))
        self._reused = any(k for _, k in choices)
        return replace(last[1], choices=tuple(choices)) if self._reused else None

    def with_proposals(self, seqs: list[Sequence], adaptive: np.ndarray, lags: dict[str, np.ndarray]) -> Plan:
        """The plan once each sequence's ``draft.proposals`` hold the lookups' real proposals."""
        self._reused = False
        blocks = self._drafter_blocks(seqs, adaptive, lags)
        for name in self.lookups:
            tracks = [seq.draft.track(name) for seq in seqs]
            lengths = np.array([len(seq.draft.proposals.get(name, ())) for seq in seqs])
            for seq, track, n, a in zip(seqs, tracks, lengths.tolist(), adaptive.tolist()):
                if a and name in seq.draft.proposals:  # asked (engine.speculative.asking)
                    track.proposes = 0.8 * track.proposes + (0.2 if n else 0.0)
            caps = np.where(adaptive, np.minimum(lengths, self.lookup_cap(len(seqs))), 0)
            blocks.append(self._block(name, tracks, caps))
        plan = self._solve(seqs, blocks, 0.0)
        self._last = ({seq.request_id: c for seq, c in zip(seqs, plan.choices)}, plan) if plan.speculates else None
        return plan

    def decide(self, plan: Plan, probed: bool) -> None:
        mode = SPECULATE if plan.speculates else (PROBE if probed else PLAIN)
        self.decision = Decision(mode, plan.speedup, sum(k for _, k in plan.choices))
        self._planned_for, self._since_planned = len(plan.choices), 0
        self._plain_seconds = plan.plain_seconds
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("goodput: %s, %d drafts over %d sequences, predicted %.3fx, plain step %.3f ms", mode,
                         self.decision.planned_drafts, len(plan.choices), plan.speedup, 1e3 * plan.plain_seconds)

    def observe_use(self, plan: Plan, adaptive: np.ndarray, lags: dict[str, np.ndarray]) -> None:
        """Which of the sequences each model drafter could draft for without a long catch-up ``plan`` gave it."""
        for name in self.drafters:
            could = adaptive & (lags[name] < SHORT_QUERY)  # [S]
            if could.any():
                chosen = np.array([src == name and k > 0 for src, k in plan.choices])  # [S]
                self._use[name] = 0.9 * self._use[name] + 0.1 * float(chosen[could].mean())

    def observe_planning(self, num_seqs: int, seconds: float) -> None:
        """The host time a plan for ``num_seqs`` sequences took that left the step plain without asking the
        lookups (a probe's asks are priced by ``cost.lookup``)."""
        self.planning.observe(num_seqs, seconds)

    def _spacing(self, cost: LinearCost, num_seqs: int) -> int:
        """Steps between two of what ``cost`` prices, so that it spends at most ``probe_budget`` of the steps."""
        if not cost.ready or self._plain_seconds <= 0.0:
            return 0
        return int(cost(num_seqs) / (self.probe_budget * self._plain_seconds))

    def _block(self, name: str, tracks: list[SourceTrack], caps: np.ndarray, scale: np.ndarray | float = 1.0,
               extra_fixed: float = 0.0, extra_per_draft: float = 0.0, drafter: int | None = None,
               catch_up: np.ndarray | float = 0.0) -> Block:
        """``name``'s options for the step's sequences: its gains, priced at the target's per-token cost (plus
        ``extra_per_draft``) and the host's per-sequence cost (plus ``extra_fixed`` and a catch-up). ``scale`` [S]:
        the chance each sequence drafts at all (a lookup not yet asked proposes with its track's share): its
        gains and what drafting costs are expected values, since nothing is drafted, verified or paid for where
        nothing is proposed; ``extra_fixed`` (asking) is paid either way. Priced whole, a lookup that proposed
        on a third of its asks cost as if it always drafted, and a sequence whose output had not yet begun to
        repeat was left plain and unasked until a probe."""
        gains = self.acceptance[name].gains(tracks, scale)  # [S, K]
        scale = np.broadcast_to(np.asarray(scale, dtype=float), (len(tracks),))  # [S]
        host = self.cost.host.per_sequence(name)
        per_draft = scale * (self._per_token + extra_per_draft)  # [S]
        fixed = scale * (host + np.asarray(catch_up, dtype=float)) + extra_fixed  # [S]
        return Block(name, gains, caps, per_draft, fixed, drafter, scale)

    def _drafter_blocks(self, seqs: list[Sequence], adaptive: np.ndarray, lags: dict[str, np.ndarray]) -> list[Block]:
        lengths = np.array([s.num_tokens for s in seqs], dtype=float)
        self._per_token = self.cost.target.per_token(lengths)  # [S]
        blocks = []
        for d, name in enumerate(self.drafters):
            _, per_token = self.cost.drafters[name].coefficients()
            tracks = [seq.draft.track(name) for seq in seqs]
            lag = lags[name]  # [S]
            # What the drafter has not seen yet is fed in its first forward: a short catch-up priced per token.
            block = self._block(name, tracks, np.where(adaptive, self.k_max, 0), extra_per_draft=per_token,
                                drafter=d, catch_up=np.where(lag < SHORT_QUERY, lag * per_token, 0.0))
            blocks.append(self._long_catch_ups(block, seqs, lag) if (lag >= SHORT_QUERY).any() else block)
        return blocks

    def _long_catch_ups(self, block: Block, seqs: list[Sequence], lag: np.ndarray) -> Block:
        """``block`` with each long catch-up (``lag`` [S] past a short query: an eager forward) priced by the
        drafter's eager forwards and spread over the steps its request has left that the drafter will draft in (at
        the share of caught-up sequences plans give it: ``observe_use``). It is paid once; priced whole at one step,
        it never paid (a first draft catches up on the whole prompt): on code at batch 1 the draft model alone ran
        at 1.05x no speculation, 1.55x spread, the default 1.82x and 2.39x (results/catch_up_spread.json)."""
        name = block.source
        short = self.cost.drafters[name]
        a, b = (self.cost.catch_ups[name] if self.cost.catch_ups[name].ready else short).coefficients()
        a1, b1 = short.coefficients()
        eager = np.maximum(0.0, a + b * (lag + 1) - (a1 + b1))  # [S]: over the one-token forward it stands in for
        per_step = 1.0 + block.gains.sum(axis=1)  # [S]: a drafting step's expected tokens at k_max drafts
        # What a request has left: at most its max_tokens, and no more than the recent requests' length (where they
        # ended earlier), however far it has run: it may end at any step.
        typical = np.inf if self._typical is None else self._typical
        left = np.array([min(s.params.max_tokens - s.num_output_tokens, typical) for s in seqs])
        steps = self._use[name] * left / per_step  # [S]: the drafting steps the catch-up serves
        price = np.where(lag >= SHORT_QUERY, eager / np.maximum(1.0, steps), 0.0)  # [S]
        return replace(block, fixed=block.fixed + block.chance * price)

    def finished(self, num_output_tokens: int) -> None:
        """A request ended with this many tokens: what a request is expected to have left (``_long_catch_ups``)
        follows the recent ones', where they end before their max_tokens."""
        self._typical = num_output_tokens if self._typical is None else 0.9 * self._typical + 0.1 * num_output_tokens

    def _solve(self, seqs: list[Sequence], blocks: list[Block], step_fixed: float) -> Plan:
        """The solver prices drafts linearly, the target's profile is not linear (engine.speculative.step_cost):
        so the profile is linearised around two totals of drafts (the last plan's, and double or half of it by
        turns, so the total can move), each plan is re-priced by the profile itself, and the better one holds."""
        per_forward = tuple(self.cost.drafters[name].coefficients()[0] for name in self.drafters)
        host_a, _ = self.cost.host.coefficients()
        n, context, target = len(seqs), sum(s.num_tokens for s in seqs) / 1000.0, self.cost.target
        if n == 1:
            t0 = target(1.0, context)
            one = solve_one(t0, blocks, per_forward, self.lookup_cap(1),
                            lambda more: np.where(more > 0, target.many(1.0 + more, context, True) - t0, 0.0),
                            self.margin, step_fixed + host_a)
            self._drafts = sum(k for _, k in one.choices) or self._drafts
            return one
        guess = self._drafts or max(2, n * self.k_max // 2)
        self._turn = not self._turn
        best: Plan | None = None
        for around in (guess, guess * 2 if self._turn else max(1, guess // 2)):
            plain, jump, per_token = target.linearize(n, context, around)
            priced = [replace(b, per_draft=b.per_draft + b.chance * per_token) for b in blocks]
            plan = solve(n, plain, priced, per_forward, self.lookup_cap(n), 0.0, step_fixed + host_a + jump, self.k_max)
            drafts = expected_drafts(plan, priced)
            if drafts:
                exact = plan.seconds - jump - per_token * drafts + target.extra(n, context, drafts)
                plan = replace(plan, seconds=exact)
            if best is None or plan.tokens / plan.seconds > best.tokens / best.seconds:
                best = plan
        assert best is not None
        if best.speedup <= 1.0 + self.margin:
            return plain_plan(n, best.plain_seconds)
        self._drafts = sum(k for _, k in best.choices)
        return best

"""Per step and per decoding sequence: where its drafts come from (the draft model or prompt lookup)
and how many. Owns the adaptive policies (one per source: their costs and acceptance differ, a lookup
being nearly free), feeds them the measured costs and outcomes, and remembers each sequence's route
for the step so the drafter and the bookkeeping after verification agree on it."""

from __future__ import annotations

from engine.config import EngineConfig, SpeculativeMethod
from engine.loader import Loaded, calibrate
from engine.sequence import Sequence
from engine.spec.adaptive import AdaptivePolicy
from engine.spec.drafter import Drafter
from engine.spec.hybrid import HybridDrafter

MODEL, LOOKUP = "model", "lookup"
MAX_DRAFTS = 16


class DraftPlanner:
    def __init__(self, config: EngineConfig, drafter: Drafter, loaded: Loaded) -> None:
        self.config = config
        self.drafter = drafter
        self.policies: dict[str, AdaptivePolicy] = {}  # empty at a fixed k
        if config.num_speculative_tokens is None:
            sources = [MODEL] if config.uses_draft_model else []
            sources += [LOOKUP] if config.uses_lookup else []
            for source in sources:
                policy = AdaptivePolicy(config.k_max)
                calibrate(policy, loaded, loaded.draft if source == MODEL else None, config.k_max, config.block_size)
                self.policies[source] = policy
        self.routes: dict[str, str] = {}  # request id -> the source it drafts from in this step
        # Lookup matches of sequences the draft model drafts for this step: scored against what the
        # step emits, free acceptance evidence for the lookup (greedy: exactly what it would have had).
        self._shadow: dict[str, list[int]] = {}

    @property
    def policy(self) -> AdaptivePolicy | None:
        """The draft model's adaptive policy (the lookup's without a draft model), None at a fixed k."""
        return self.policies.get(MODEL) or self.policies.get(LOOKUP)

    def plan(self, decoding: list[Sequence]) -> dict[str, int]:
        """k per decoding sequence for this step, its route remembered."""
        self.routes.clear()
        self._shadow.clear()
        lens = {}
        for seq in decoding:
            source, k = self.plan_one(seq, len(decoding))
            self.routes[seq.request_id] = source
            lens[seq.request_id] = min(k, MAX_DRAFTS)
        return lens

    def plan_one(self, seq: Sequence, batch: int) -> tuple[str, int]:
        """(source, k) for one decoding sequence. A fixed k (the request's or the engine's) is used as
        is; otherwise each source's policy proposes its best k and the source promising more tokens per
        unit of step cost wins, the lookup only where the context matched."""
        k = seq.params.num_speculative_tokens
        if k is None:
            k = self.config.num_speculative_tokens
        seeded = seq.params.seed is not None and not seq.params.greedy
        rid = seq.request_id
        if not isinstance(self.drafter, HybridDrafter):
            source = LOOKUP if self.config.speculative_method is SpeculativeMethod.NGRAM else MODEL
            return source, k if k is not None else self.policies[source].choose(rid, batch, batch_independent=seeded)
        if k is not None:
            # No rates to compare at a fixed k: the lookup takes the step when a suffix of two or more
            # tokens matched (a lone token recurs nearly everywhere, and its guesses rarely hold).
            match = self.drafter.match(seq, k, n_min=max(2, self.drafter.n_min)) if k else []
            return (LOOKUP, min(k, len(match))) if match else (MODEL, k)
        # Adaptive: any match may compete; each source's own acceptance history decides.
        match = self.drafter.match(seq, self.config.k_max)
        model, lookup = self.policies[MODEL], self.policies[LOOKUP]
        # A seeded sampled request's route, like its k, must not depend on what shares its batch: both
        # rates then use the frozen batch-1 costs and the request's own acceptance history.
        if match and lookup.rate(rid, batch, seeded, len(match)) >= model.rate(rid, batch, seeded):
            return LOOKUP, lookup.choose(rid, batch, seeded, len(match))
        if match:
            self._shadow[rid] = match
        return MODEL, model.choose(rid, batch, batch_independent=seeded)

    def uses_lookup(self, request_id: str) -> bool:
        return self.routes.get(request_id) == LOOKUP

    def observe_costs(self, num_fed: int, target_seconds: float) -> None:
        # The draft model's forward times are drained every step, policy or not: with a fixed k nobody
        # else would empty them.
        draft_times = getattr(self.drafter, "forward_times", None) or []
        for policy in self.policies.values():
            policy.target_cost.observe(num_fed, target_seconds)
        if MODEL in self.policies:
            for n, secs in draft_times:
                self.policies[MODEL].draft_cost.observe(n, secs)
        if draft_times:
            draft_times.clear()

    def observe(self, request_id: str, k: int, accepted: int, emitted: list[int]) -> None:
        """One sequence's verified step: k drafts, ``accepted`` of them kept, ``emitted`` the tokens out."""
        shadow = self._shadow.get(request_id)
        if shadow:
            # Censored at what the step emitted: a mismatch past it is unseen, so not a rejection.
            seen = shadow[: len(emitted)]
            agreed = next((i for i, (a, b) in enumerate(zip(seen, emitted)) if a != b), len(seen))
            self.policies[LOOKUP].observe(request_id, len(seen), agreed)
        policy = self.policies.get(self.routes.get(request_id, MODEL))
        if k and policy is not None:
            policy.observe(request_id, k, accepted)

    def forget(self, request_id: str) -> None:
        for policy in self.policies.values():
            policy.forget(request_id)

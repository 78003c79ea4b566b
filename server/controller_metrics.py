"""The goodput controller's series: what it chose each step, what it predicted, the step-cost model it priced
the choice with (read from the engine when scraped), and the drafters' forwards, which stay at 0 while it
keeps speculation off."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from engine import StepStats

DECISIONS = ("plain", "probe", "speculate")


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry, self.model_name, m = registry, model_name, ["model_name"]
        self.draft_forwards = Counter(
            "specd:spec_decode_num_draft_forwards", "Forwards the model drafters ran (draft positions and catch-ups).",
            m, registry=registry,
        ).labels(model_name)
        family = Counter(
            "specd:spec_controller_steps", "Steps by the goodput controller's choice: plain (no speculative work), "
            "probe (plain, the lookups asked for evidence) or speculate.", [*m, "decision"], registry=registry,
        )
        self.steps = {d: family.labels(model_name, d) for d in DECISIONS}
        self.speedup = Gauge(
            "specd:spec_controller_predicted_speedup", "The last planned step's expected tokens per second over the "
            "plain step's (1 when it chose the plain step).", m, registry=registry,
        ).labels(model_name)

    def declare_cost_model(self, parameters: Callable[[], dict[str, float]]) -> None:
        """``specd:spec_controller_cost_seconds{term}``, one series per term of the step-cost model."""
        family = Gauge(
            "specd:spec_controller_cost_seconds", "The goodput controller's step-cost model, profiled at start-up and "
            "corrected every step: seconds per term (target_step, target_per_token, a drafter's per_forward and "
            "per_token, lookup and host work per step and per sequence, ...).", ["model_name", "term"],
            registry=self.registry,
        )
        for term in parameters():
            family.labels(self.model_name, term).set_function(lambda term=term: parameters().get(term, 0.0))

    def observe_step(self, step: StepStats) -> None:
        if step.num_draft_forwards:
            self.draft_forwards.inc(step.num_draft_forwards)
        if step.speculation in self.steps:
            self.steps[step.speculation].inc()
            self.speedup.set(step.predicted_speedup)

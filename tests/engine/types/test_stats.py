"""Speculation stats split by the draft source that proposed the tokens: per step, cumulatively and per
request, each split sums exactly to its total, and tokens the grammar forces count under "grammar" even
when they follow another source's drafts in the same step."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine import GRAMMAR_SOURCE, Constraint, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.types.config import EngineConfig
from engine.types.draft_state import DraftState
from engine.types.outputs import CompletionOutput, RequestOutput
from engine.types.sequence import SourceTokens
from engine.types.stats import DraftShare, SourceStepStats, StepStats, shares

pytestmark = pytest.mark.timeout(300)

GRAMMAR = GRAMMAR_SOURCE
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18], [40, 41, 42, 43, 40, 41, 42], [3, 1, 4, 1, 5]]
SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["fib", "point", "os"]}, "size": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["kind", "size", "ok"],
    "additionalProperties": False,
}


def engine_for(ms, method: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ms.target), draft_model=str(ms.draft), speculative_method=method,
                                  num_speculative_tokens=4, dtype="float32", device="cpu", **kw))


def state(source: str | None, forced_at: int = 0, num_forced: int = 0) -> DraftState:
    return DraftState(source=source, forced_at=forced_at, num_forced=num_forced)


def test_the_split_rule_gives_a_source_its_own_drafts_and_the_grammar_the_ones_it_forced():
    assert shares(state("ngram"), 4, 2) == (DraftShare("ngram", 0, 4, 2),)
    assert shares(state("draft_model"), 0, 0) == ()
    # Three of the draft model's drafts, then two the grammar forced after them.
    assert shares(state("draft_model", 3, 2), 5, 1) == (DraftShare("draft_model", 0, 3, 1),
                                                        DraftShare(GRAMMAR, 3, 2, 0))
    assert shares(state("draft_model", 3, 2), 5, 4) == (DraftShare("draft_model", 0, 3, 3),
                                                        DraftShare(GRAMMAR, 3, 2, 1))
    assert shares(state(GRAMMAR, 0, 3), 3, 3) == (DraftShare(GRAMMAR, 0, 3, 3),)


def test_a_steps_sources_sum_to_its_totals_and_a_sequence_step_counts_once():
    per_seq = [shares(state("draft_model", 2, 2), 4, 3), shares(state("ngram"), 3, 1),
               shares(state(GRAMMAR, 0, 2), 2, 2)]
    by = {s.name: s for s in SourceStepStats.of(per_seq)}

    def counts(name: str) -> tuple[int, int, int]:
        return by[name].num_drafts, by[name].num_draft_tokens, by[name].num_accepted_tokens

    assert counts("draft_model") == (1, 2, 2)
    assert counts(GRAMMAR) == (1, 4, 3), "two forced after the draft model's, two in a step of its own"
    assert by[GRAMMAR].accepted_per_position == (1, 1, 1, 0), "positions among the step's drafts"
    assert by["ngram"].accepted_per_position == (1, 0, 0)
    assert sum(s.num_drafts for s in by.values()) == 3


@dataclass
class Run:
    """One engine run to completion: every step's stats, each request's last output, and what each
    request's per-source counts must be, worked out here from its DraftState and its totals' growth."""

    steps: list[StepStats] = field(default_factory=list)
    final: dict[str, RequestOutput] = field(default_factory=dict)
    completions: dict[str, CompletionOutput] = field(default_factory=dict)
    expected: dict[str, dict[str, SourceTokens]] = field(default_factory=dict)
    mixed_steps: int = 0  # sequence-steps with a source's own drafts and grammar-forced ones after them


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> Run:
    r = Run()
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
        r.completions[str(i)] = CompletionOutput(str(i), prompt)
        r.expected[str(i)] = {}
    seqs = dict(engine.seqs)  # finished sequences leave engine.seqs; their plan is read after their last step
    while engine.has_unfinished():
        outputs = engine.step()
        if engine.last_step is not None and (not r.steps or engine.last_step is not r.steps[-1]):
            r.steps.append(engine.last_step)
        for out in outputs:
            prev = r.final.get(out.request_id)
            drafted = out.num_draft_tokens - (prev.num_draft_tokens if prev else 0)
            accepted = out.num_accepted_tokens - (prev.num_accepted_tokens if prev else 0)
            if drafted:
                d = seqs[out.request_id].draft
                own = d.forced_at if d.num_forced else drafted
                r.mixed_steps += bool(own and d.num_forced and d.source != GRAMMAR)
                exp = r.expected[out.request_id]
                # Acceptance is a prefix: the source's drafts come first, the grammar's after them.
                ours = min(accepted, own)
                for name, n, a in ((d.source, own, ours), (GRAMMAR, drafted - own, accepted - ours)):
                    if n:
                        exp[name] = exp.get(name, SourceTokens()).plus(n, a)
            r.final[out.request_id] = out
            r.completions[out.request_id].add(out)
    return r


def assert_every_split_sums_to_its_total(engine: LLMEngine, r: Run) -> None:
    for i, st in enumerate(r.steps):
        by = st.by_source
        assert sum(s.num_drafts for s in by) == st.num_drafts, f"step {i}"
        assert sum(s.num_draft_tokens for s in by) == st.num_draft_tokens, f"step {i}"
        assert sum(s.num_accepted_tokens for s in by) == st.num_accepted_tokens, f"step {i}"
        per_pos = [sum(s.accepted_per_position[j] for s in by if j < len(s.accepted_per_position))
                   for j in range(len(st.accepted_per_position))]
        assert per_pos == list(st.accepted_per_position), f"step {i}"
    stats = engine.spec_stats
    assert sum(s.num_drafts for s in stats.by_source.values()) == stats.num_drafts
    assert sum(s.num_draft_tokens for s in stats.by_source.values()) == stats.num_draft_tokens
    assert sum(s.num_accepted_tokens for s in stats.by_source.values()) == stats.num_accepted_tokens
    for rid, out in r.final.items():
        assert out.spec_by_source == r.expected[rid], f"request {rid}"
        assert r.completions[rid].spec_by_source == out.spec_by_source, f"request {rid}: CompletionOutput"
        assert sum(t.num_draft_tokens for t in out.spec_by_source.values()) == out.num_draft_tokens
        assert sum(t.num_accepted_tokens for t in out.spec_by_source.values()) == out.num_accepted_tokens
    # Cumulative per source = the requests' per-source counts (no audits run here).
    names = {n for exp in r.expected.values() for n in exp}
    assert set(stats.by_source) == names
    for name in names:
        s = stats.by_source[name]
        assert s.num_draft_tokens == sum(e[name].num_draft_tokens for e in r.expected.values() if name in e), name
        assert s.num_accepted_tokens == sum(e[name].num_accepted_tokens for e in r.expected.values() if name in e), name
        assert s.acceptance_rate == s.num_accepted_tokens / s.num_draft_tokens
    # The mean accepted length is the accepted-length histogram's mean (docs: specd:spec_decode_accepted_length).
    lengths = [n for st in r.steps for n in st.accepted_lengths]
    assert stats.mean_accepted_length == pytest.approx(sum(lengths) / len(lengths))


def test_a_hybrid_run_splits_steps_totals_and_requests_exactly_between_the_draft_model_and_lookups(model_sets):
    engine = engine_for(model_sets["llama"], "hybrid")
    r = run(engine, [(p, GREEDY) for p in PROMPTS] + [(PROMPTS[1], SAMPLED)])
    drafting = engine.drafting
    sources = {s.name for s in (*drafting.drafters, *drafting.lookups)}
    assert set(engine.spec_stats.by_source) == sources, "the draft model and both lookups drafted"
    assert all(s.num_draft_tokens > 0 for s in engine.spec_stats.by_source.values())
    assert any(len(st.by_source) > 1 for st in r.steps), "some step mixed the two sources"
    assert_every_split_sums_to_its_total(engine, r)


def test_tokens_the_grammar_forces_count_under_grammar_even_after_the_draft_models_own(model_sets):
    engine = engine_for(model_sets["llama"], "draft_model", block_size=4)
    structured = [SamplingParams(max_tokens=40, temperature=0.0, constraint=c)
                  for c in (Constraint.json_schema(SCHEMA), Constraint.choice(["print(i)", "return fib(n - 1)"]))]
    r = run(engine, [(PROMPTS[0], structured[0]), (PROMPTS[2], structured[1]), (PROMPTS[3], GREEDY)])
    stats = engine.spec_stats
    grammar = stats.by_source[GRAMMAR]
    assert grammar.num_draft_tokens == stats.num_forced_draft_tokens > 0
    assert grammar.num_accepted_tokens == stats.num_forced_accepted_tokens
    assert stats.by_source["draft_model"].num_draft_tokens == stats.num_draft_tokens - stats.num_forced_draft_tokens
    assert r.mixed_steps > 0, "the grammar forced tokens after the draft model's own drafts in some step"
    assert GRAMMAR not in r.final["2"].spec_by_source, "the unconstrained request has no grammar"
    assert_every_split_sums_to_its_total(engine, r)

"""The losslessness audit: finished greedy requests re-run with speculation off, in the background,
and counted as match, mismatch or near-tie."""

from __future__ import annotations

import logging

import pytest

import engine.sample.verifier as verifier_module
from engine import LLM, SamplingParams
from engine.core.audit import Auditor, AuditResult
from engine.types.sequence import AuditCase, Sequence, TokenLogprob
from tests.engine.lossless import prompts_for

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def audited_llm(ms, fraction: float = 1.0) -> LLM:
    return LLM(model=str(ms.target), draft_model=str(ms.draft), speculative_method="draft_model",
               num_speculative_tokens=4, dtype="float32", device="cpu", audit_fraction=fraction)


def run_audits(llm: LLM) -> None:
    """generate() returns when the requests finish; their audits run on in the engine's spare steps."""
    while llm.engine.has_unfinished():
        assert not any(llm.engine.step()), "an audit's output reached a caller"


def test_a_lossless_engine_audits_every_greedy_request_as_a_match(model_sets, tokenizer_dir):
    llm = audited_llm(model_sets["llama"])
    prompts = prompts_for(tokenizer_dir)
    outs = llm.generate(prompts, GREEDY)
    assert all(o.num_draft_tokens for o in outs)
    run_audits(llm)
    stats = llm.engine.audit_stats
    assert (stats.match, stats.mismatch, stats.near_tie) == (len(prompts), 0, 0)
    assert not llm.engine.seqs and llm.engine.block_manager.usage == 0


def test_an_injected_mismatch_is_counted_and_its_request_logged(model_sets, tokenizer_dir, monkeypatch, caplog):
    """A broken verifier that accepts every draft: speculative output changes, and the audit says so."""
    # Both paths broken: the tensor rule and the greedy fast path's host rule.
    monkeypatch.setattr(verifier_module, "accepted_prefix", lambda *args: args[4].clone())  # num_drafts
    monkeypatch.setattr(verifier_module, "greedy_accepted", lambda drafts, choice: len(drafts))
    llm = audited_llm(model_sets["llama"])
    with caplog.at_level(logging.ERROR, logger="engine.core.audit"):
        outs = llm.generate(prompts_for(tokenizer_dir)[:2], GREEDY)
        monkeypatch.undo()
        run_audits(llm)
    assert llm.engine.audit_stats.mismatch == 2 and llm.engine.audit_stats.match == 0
    assert {o.request_id for o in outs} <= {r.message.split("request ")[1].split(" ")[0] for r in caplog.records}


def test_the_fraction_audits_that_share_of_eligible_requests(model_sets, tokenizer_dir):
    llm = audited_llm(model_sets["llama"], fraction=0.25)
    prompts = prompts_for(tokenizer_dir)
    llm.generate(prompts, GREEDY)
    llm.generate(prompts, [SamplingParams(max_tokens=8, temperature=1.0)] * len(prompts))  # not greedy: never
    run_audits(llm)
    assert llm.engine.audit_stats.match == len(prompts) // 4


def test_an_audit_runs_only_when_no_client_request_waits(model_sets, tokenizer_dir):
    ms = model_sets["llama"]
    llm = LLM(model=str(ms.target), draft_model=str(ms.draft), speculative_method="draft_model",
              num_speculative_tokens=4, dtype="float32", device="cpu", audit_fraction=1.0, max_num_seqs=1)
    engine = llm.engine
    prompts = prompts_for(tokenizer_dir)
    llm.generate(prompts[:1], GREEDY)
    assert len(engine.scheduler.background) == 1
    for rid, p in (("a", prompts[1]), ("b", prompts[2])):
        engine.add_request(rid, p, SamplingParams(max_tokens=6, temperature=0.0))
    order: list[str] = []
    while engine.has_unfinished():
        engine.step()
        order += [s.request_id for s in engine.scheduler.running if s.request_id not in order]
    assert order == ["a", "b", "audit:gen-0", "audit:a", "audit:b"], "audits after every client, oldest first"


def _finished_audit(got: list[int], want: list[int], gap: float) -> Sequence:
    seq = Sequence("audit:r", [1, 2], GREEDY, audit=AuditCase("r", tuple(want)))
    seq.token_ids += got
    seq.logprobs = [TokenLogprob(t, -0.5, ((t, -0.5), (t + 1, -0.5 - gap))) for t in got]
    return seq


@pytest.mark.parametrize(("gap", "result"), [(5e-5, AuditResult.NEAR_TIE), (0.3, AuditResult.MISMATCH)])
def test_a_divergence_at_a_near_tie_is_not_a_mismatch(gap, result):
    assert Auditor(1.0).judge(_finished_audit([7, 8, 9], [7, 5, 9], gap)) is result
    assert Auditor(1.0).judge(_finished_audit([7, 8, 9], [7, 8, 9], gap)) is AuditResult.MATCH

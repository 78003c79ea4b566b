"""benchmarks/compare.py's pure parts: the prompt sets, the summary and the speedup bound."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(autouse=True)
def bench_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))


def row(rnd: int, system: str, tps: float, counters: dict | None = None, conc: int = 1, same: int | None = None,
        ) -> dict:
    return {"round": rnd, "set": "code", "concurrency": conc, "system": system, "requests": 4, "failed": 0,
            "tokens_per_s": tps, "ttft_ms": [20.0, 30.0], "tpot_ms": [4.0, 5.0], "output_tokens": 512,
            "counters": counters or {}, "same_text": same}


def test_the_bound_is_e_over_1_plus_kc_from_measured_acceptance_and_costs():
    from engine_bench.bound import expected
    from peer_bench import report

    # specd none: 100 steps, 5 ms of target forward each.
    none = {"engine_steps": 100.0, "target_forward_seconds": 0.5, "generation_tokens": 100.0}
    # 50 drafting steps at k = 4 whose mean accepted length fits alpha = 0.5 exactly; drafting costs
    # 1 ms per draft token and each verify forward 6 ms (1 ms more than a plain step).
    accepted = 50 * (expected(0.5, 4) - 1)
    spec = {"spec_decode_num_drafts": 50.0, "spec_decode_num_draft_tokens": 200.0,
            "spec_decode_num_accepted_tokens": accepted, "draft_seconds": 0.2, "target_forward_seconds": 0.3,
            "engine_steps": 50.0, "generation_tokens": 50 + accepted}
    lines = report.summarize([row(0, "specd none", 100.0, none), row(0, "specd adaptive", 150.0, spec, same=4)])
    line = next(x for x in lines if x["system"] == "specd adaptive")
    c = (0.2 + (0.3 - 50 * 0.005)) / 200 / 0.005  # (drafting + extra verify) per draft token, over s
    assert line["alpha"] == pytest.approx(0.5, abs=1e-6) and line["mean_k"] == 4
    assert line["c"] == pytest.approx(c)
    assert line["bound"] == pytest.approx(expected(0.5, 4) / (1 + 4 * c))
    assert line["of_bound"] == pytest.approx(1.5 / line["bound"])
    assert line["acceptance"] == pytest.approx(accepted / 200)
    assert line["same_text_as_none"] == 4 and line["compared_texts"] == 4


def test_ratios_are_ratios_of_medians_and_only_batch_1_gets_a_bound():
    from peer_bench import report

    counters = {"spec_decode_num_drafts": 1.0, "spec_decode_num_draft_tokens": 2.0,
                "spec_decode_num_accepted_tokens": 1.0, "draft_seconds": 0.01, "target_forward_seconds": 0.01,
                "engine_steps": 1.0, "generation_tokens": 2.0}
    rows = [row(r, "specd none", base, {"engine_steps": 1.0, "target_forward_seconds": 0.01}, conc=4)
            for r, base in enumerate((100.0, 200.0, 100.0))]
    rows += [row(r, "specd adaptive", tps, counters, conc=4) for r, tps in enumerate((150.0, 220.0, 130.0))]
    line = next(x for x in report.summarize(rows) if x["system"] == "specd adaptive")
    assert line["vs_none"] == pytest.approx(1.5)  # medians 150 / 100; the median of per-round ratios would be 1.3
    assert line["vs_none_per_round"] == pytest.approx([1.5, 1.1, 1.3])
    assert line["tokens_per_s"] == 150.0 and "bound" not in line
    assert "| code | 4 | specd adaptive | 150.0 | 0% | 1.50 |" in report.table(report.summarize(rows))


def test_versus_is_a_ratio_of_medians_with_the_per_round_ratios_kept():
    from peer_bench import report

    rows = [{**row(r, "llama.cpp spec", b), "round": r} for r, b in enumerate((100.0, 200.0, 100.0))]
    rows += [{**row(r, "specd adaptive", a), "round": r} for r, a in enumerate((150.0, 220.0, 130.0))]
    (pair,) = [x for x in report.versus(rows) if x["a"] == "specd adaptive"]
    assert pair["ratio"] == pytest.approx(1.5) and pair["per_round"] == pytest.approx([1.5, 1.1, 1.3])


def test_the_loop_share_sits_beside_each_throughput():
    from peer_bench import report

    rows = [{**row(0, "specd none", 100.0), "loops": 1}, {**row(1, "specd none", 100.0), "loops": 2}]
    (line,) = report.summarize(rows)
    assert line["loop_share"] == pytest.approx(3 / 8)  # 3 looping outputs of 2 x 4 requests
    assert "| code | 1 | specd none | 100.0 | 38% | 1.00 |" in report.table([line])


def test_prompt_sets_are_deterministic_held_out_and_end_mid_line():
    from peer_bench.prompts import EDIT_INSTRUCTION, code_prompts, edit_prompts
    from transformers import AutoTokenizer

    from recipe.corpus import split, stdlib_files

    tok = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "models" / "default" / "target")
    code, edit = code_prompts(tok, 6), edit_prompts(tok, 6)
    assert code == code_prompts(tok, 6) and len(set(code)) == 6 and len(set(edit)) == 6
    held_out = [f.read() for f in split(stdlib_files())[1]]
    for prompt in code:
        assert not prompt.endswith("\n") and len(tok.encode(prompt)) >= 96
        assert any(prompt in text for text in held_out), "code prompts come from held-out files only"
    for prompt in edit:
        snippet, first_line = prompt.split(EDIT_INSTRUCTION)
        assert snippet.split("\n", 1)[0] == first_line and any(snippet in text for text in held_out)


def test_compare_refuses_to_run_without_its_baseline(monkeypatch, capsys):
    import compare

    monkeypatch.setattr(sys, "argv", ["compare.py", "--systems", "specd adaptive"])
    with pytest.raises(SystemExit):
        compare.main()
    assert "specd none" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_a_small_comparison_runs_end_to_end_and_every_system_writes_the_same_text(tmp_path, monkeypatch):
    import json

    import compare

    out = tmp_path / "results" / "run.json"
    systems = ["specd adaptive", "specd none", "transformers serve", "generate prompt lookup"]
    monkeypatch.setattr(sys, "argv", [
        "compare.py", "--systems", *systems, "--sets", "edit", "--concurrency", "1", "2", "--prompts", "2",
        "--max-tokens", "8", "--rounds", "1", "--out", str(out),
        "--attempts", "1",  # measure once: a test never waits for a quiet machine
    ])
    compare.main()
    summary = json.loads(out.read_text())["summary"]
    assert {(x["system"], x["concurrency"]) for x in summary} == {
        *((s, 1) for s in systems), *((s, 2) for s in systems[:3])}, "generate() runs at batch 1 only"
    for x in summary:
        assert x["failed"] == 0 and x["tokens_per_s"] > 0
        if x["system"] != "specd none":
            assert x["same_text_as_none"] == x["compared_texts"] > 0, f"{x['system']}: greedy text differs"
    # The JSON and its plots, named after it, and nothing else: compare.py never writes a doc. The bound's plot
    # comes with a speculative system that drafted at batch 1 (whether the controller chose to in 8 tokens
    # depends on the host's timings, so the test holds the plot to the data, not to a choice).
    bound = ["run_bound.png"] if any(x.get("bound") for x in summary) else []
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(["run.json", "run_throughput.png", *bound])


def test_each_batch_takes_the_sets_next_prompts_and_counts_what_a_server_was_sent_before():
    from compare import Batches

    fresh = Batches({"code": ["a", "b", "c", "d", "e", "warm"]}, reuse=False)
    assert fresh.next("code", 2) == (["a", "b"], 0)
    assert fresh.next("code", 3) == (["c", "d", "e"], 0)
    assert fresh.next("code", 2) == (["warm", "a"], 2), "past the end: the warm-up's prompt, then the first again"
    reused = Batches({"code": ["a", "b", "c"]}, reuse=True)
    assert reused.next("code", 2) == (["a", "b"], 0)
    assert reused.next("code", 2) == (["a", "b"], 2)


def test_a_variant_is_its_system_started_with_the_arguments_added():
    import argparse

    import compare

    ap = argparse.ArgumentParser()
    args = argparse.Namespace(target="t", draft="d", device="cpu", base_tree=None, threads=2, concurrency=[1],
                              systems=["specd none compiled"],
                              variant=[["specd none compiled", "--prefill-hold-steps 0"]])
    none, variant = compare.choose_systems(args, ap)
    assert variant.name == "specd none compiled (--prefill-hold-steps 0)"
    assert variant.args == (*none.args, "--prefill-hold-steps", "0")
    args.variant = [["llama.cpp spec", "-x"]]
    with pytest.raises(SystemExit):
        compare.choose_systems(args, ap)


def test_rejudging_a_results_json_replaces_each_verdict_and_the_summary(tmp_path):
    import json

    import compare
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = BENCH.parent / "models" / "default" / "target"
    tok, model = AutoTokenizer.from_pretrained(target), AutoModelForCausalLM.from_pretrained(target)
    prompt = "def add(a, b):\n    return"
    ids = tok.encode(prompt)
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):].tolist()
    logits = model(torch.tensor([ids + out[:1]])).logits[0, -1]
    other = out[:1] + [int(torch.topk(logits, 2).indices[1])]  # the runner-up at the second token
    stale = {"index": 0, "kind": "near-tie", "prompt": prompt, "text": tok.decode(other),
             "baseline_text": tok.decode(out), "token": 7, "top2_gap": 0.0}
    rows = [row(0, "specd none", 10.0), row(0, "specd adaptive", 12.0, same=3) | {"differences": [stale]}]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"args": {"baseline": "specd none"}, "rows": rows, "summary": [], "versus": []}))
    compare.rejudge(path, target)
    data = json.loads(path.read_text())
    case = data["rows"][1]["differences"][0]
    assert case["kind"] == "unexplained" and case["token"] == 1 and case["follows"] == "baseline"
    line = next(x for x in data["summary"] if x["system"] == "specd adaptive")
    assert line["differences"] == {"unexplained": 1} and line["same_text_as_none"] == 3

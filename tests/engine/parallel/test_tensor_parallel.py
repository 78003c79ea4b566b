"""A target sharded over 2 ranks (CPU processes joined by gloo) decodes as the target alone does: greedy output
equal to transformers' generate, seeded samples equal to one rank's, near-ties of the all-reduce's summation order
aside, for three architectures transformers can shard and the draft-model, n-gram and default hybrid methods.
Each rank holds half of the sharded weights and half of the KV heads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.parallel.shares import rank_weight_bytes
from tests.engine.lossless import (
    MAX_NEW,
    Reference,
    assert_same_as_target,
    assert_same_sample_unless_near_tie,
    prompts_for,
)

ROOT = Path(__file__).resolve().parents[3]
ARCHS = ("llama", "qwen3", "mistral")
# The default hybrid (draft model beside suffix and n-gram lookup) at adaptive k; the single drafters at k = 4 so
# that every step verifies drafts. Small token budgets chunk the prompts.
METHODS = {
    "draft_model": dict(speculative_method="draft_model", num_speculative_tokens=4),
    "ngram": dict(speculative_method="ngram", num_speculative_tokens=4, max_num_batched_tokens=16),
    "hybrid": dict(speculative_method="hybrid"),
}
SEEDS = [11, 12, 13, 14, 15, 16, 17, 18]
TEMPERATURE, TOP_P = 0.8, 0.95


def engine_options(method: str, draft: Path) -> dict:
    options = dict(METHODS[method], device="cpu", dtype="float32", block_size=4)
    if method != "ngram":
        options["draft_model"] = str(draft)
    return options


def cases(model_sets, prompts: list[list[int]]) -> list[dict]:
    return [
        {"label": f"{arch}/{method}", "model": str(model_sets[arch].target), "ranks": 2, "max_new": MAX_NEW,
         "engine": engine_options(method, model_sets[arch].draft), "prompts": prompts, "seeds": SEEDS,
         "temperature": TEMPERATURE, "top_p": TOP_P}
        for arch in ARCHS for method in METHODS
    ]


@pytest.fixture(scope="module")
def two_ranks(model_sets, tokenizer_dir, tmp_path_factory) -> tuple[list[dict], dict]:
    """Every case run once on 2 ranks, in one rank-0 process (the ranks are started once and load each target)."""
    tmp = tmp_path_factory.mktemp("tp")
    spec = cases(model_sets, prompts_for(tokenizer_dir))
    (tmp / "spec.json").write_text(json.dumps({"cases": spec}))
    proc = subprocess.run([sys.executable, "-m", "tests.engine.parallel.tp_engine", str(tmp / "spec.json"),
                           str(tmp / "out.json")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return spec, json.loads((tmp / "out.json").read_text())


def of(arch: str, spec: list[dict]) -> list[dict]:
    """The cases of one architecture."""
    return [case for case in spec if case["label"].startswith(f"{arch}/")]


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_decode_greedily_as_the_target_alone(arch, two_ranks, model_sets):
    spec, results = two_ranks
    ref = Reference(model_sets[arch].target)
    for case in of(arch, spec):
        got = results[case["label"]]
        for prompt, out in zip(case["prompts"], got["greedy"]):
            assert_same_as_target(ref, prompt, out, f"{case['label']} 2 ranks")
        assert got["draft_tokens"] > 0, f"{case['label']}: speculation never ran, so this proved nothing"


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_draw_the_seeded_samples_one_rank_draws(arch, two_ranks, model_sets):
    spec, results = two_ranks
    ref = Reference(model_sets[arch].target)
    for case in of(arch, spec):
        one = LLM(case["model"], **case["engine"])
        params = [SamplingParams(max_tokens=MAX_NEW, temperature=TEMPERATURE, top_p=TOP_P, seed=s) for s in SEEDS]
        want = [o.token_ids for o in one.generate(case["prompts"], params)]
        for prompt, seed, got, w in zip(case["prompts"], SEEDS, results[case["label"]]["sampled"], want):
            assert_same_sample_unless_near_tie(ref, prompt, got, w, seed, TEMPERATURE, TOP_P,
                                               f"{case['label']} seed {seed}")


@pytest.mark.parametrize("arch", ARCHS)
def test_each_rank_holds_half_the_sharded_weights_and_half_the_kv_heads(arch, two_ranks, model_sets):
    _, results = two_ranks
    target = AutoModelForCausalLM.from_pretrained(model_sets[arch].target, dtype=torch.float32)
    text = target.config.get_text_config()
    facts = results[f"{arch}/hybrid"]["facts"]
    assert [f["rank"] for f in facts] == [0, 1]
    for f in facts:
        assert f["sharded_local"] * 2 == f["sharded_full"], f
        assert f["kv_heads"] == [text.num_key_value_heads // 2] * text.num_hidden_layers, f
        assert f["sharded_full"] + f["replicated"] == sum(p.numel() for p in target.parameters()), f
        # What the dry run plans per rank (from the plan alone, on the meta device) is what a rank holds.
        held = (f["sharded_local"] + f["replicated"]) * 4 + sum(b.numel() * 4 for b in target.buffers())
        assert rank_weight_bytes(target, 2) == held, f

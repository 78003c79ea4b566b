"""Sampled speculative output is distributed exactly as the target's own samples.

An 8-token vocabulary makes the exact joint law of the first three generated tokens computable by
brute force (8 + 64 target forwards), so a chi-square test over many engine samples has real power.
The draft is a deliberately different random model, so acceptance is partial and both the accept
path and the residual path are exercised."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, LlamaConfig

from engine import LLM, SamplingParams
from engine.speculative.source import Proposal

# On a GPU (SPECD_TEST_DEVICE) these stay float32: the chi-square compares with the float32 law, which bfloat16's
# rounded probabilities would fail at this many samples whatever the acceptance rule did.
from tests.device import SAMPLED_ENGINE
from tests.engine.lossless import (
    alternate_drafters,
    cut_at_the_median,
    flip_plain_and_speculative,
    reference_transform,
)

V = 8
PROMPT = [1, 2, 3, 1, 2]
N = 8_000
SETTINGS = {
    "temperature=1": dict(temperature=1.0),
    "top_k=3": dict(temperature=1.0, top_k=3),
    "top_p=0.8": dict(temperature=0.9, top_p=0.8),
}


def _peaky_model(out: Path, seed: int, layers: int = 2) -> None:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=7,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # random tiny models are near-uniform; make p far from it
    model.save_pretrained(out)


def _peaky_head(out: Path, seed: int) -> None:
    """An EAGLE-3 head for the target above, over 6 of its 8 tokens: q is 0 at the other two, so the residual
    distribution alone must supply them."""
    from engine.models.eagle_head import Eagle3Head, save_head

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, draft_vocab_size=6,
    )
    head = Eagle3Head(cfg, 32, own_embeddings=True)
    head.set_draft_vocab(torch.tensor([0, 1, 2, 4, 5, 7]))
    with torch.no_grad():
        head.lm_head.weight.mul_(0.1)  # near-uniform over its 6 tokens: partial acceptance against the peaky target
    save_head(head, out)


def _with_exit_head(target: Path, out: Path) -> None:
    """The target with an exit head for its first layer over 6 of its 8 tokens (q = 0 at the other two): its
    own LM head rows for them, scaled down so that q is flatter than p."""
    import shutil

    from engine.models import exit_head

    shutil.copytree(target, out)
    rows = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).lm_head.weight
    head = exit_head.ExitHead(32, V, 6, 1)
    head.set_draft_vocab(torch.tensor([0, 1, 3, 4, 6, 7]))
    with torch.no_grad():
        head.lm_head.weight.copy_(0.1 * rows[head.draft_ids()])
    exit_head.save(head, out / exit_head.DIR_NAME)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vocab8")
    _peaky_model(root / "target", seed=11)
    _peaky_model(root / "draft", seed=12)
    _peaky_head(root / "eagle", seed=13)
    _with_exit_head(root / "target", root / "target-exit")
    return root / "target", root / "draft"


@torch.inference_mode()
def exact_joint(model_dir: Path, **params) -> np.ndarray:
    """P(t1, t2, t3) under the model alone, shape [V, V, V]."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    dist = lambda ids: reference_transform(model(torch.tensor([ids])).logits[0, -1], **params)  # noqa: E731
    joint = np.zeros((V, V, V))
    p1 = dist(PROMPT)
    for a in range(V):
        if p1[a] == 0:
            continue
        p2 = dist(PROMPT + [a])
        for b in range(V):
            if p2[b] > 0:
                joint[a, b] = float(p1[a]) * float(p2[b]) * dist(PROMPT + [a, b]).double().numpy()
    return joint


def engine_samples(llm: LLM, seeded: bool = False, **params) -> np.ndarray:
    """N sampled continuations (4 tokens, so positions 2 and 3 come out of draft verification). Seeded:
    every request has its own seed, so each is verified by the shared-noise choice instead of rejection."""
    counts = np.zeros((V, V, V))
    for batch in range(N // 2000):
        plist = [SamplingParams(max_tokens=4, ignore_eos=True, seed=batch * 2000 + i if seeded else None, **params)
                 for i in range(2000)]
        for out in llm.generate([PROMPT] * 2000, plist):
            a, b, c = out.token_ids[:3]
            counts[a, b, c] += 1
    return counts


def route_half_to_lookup(llm: LLM) -> None:
    """This tiny vocabulary's 2-gram matches are too rare to mix sources often, so half the requests
    get a fixed "lookup" proposal: verification must be exact for any one-hot proposal, likely or not,
    next to the draft model's real distributions in the same step."""
    lookup = llm.engine.drafting.lookup
    propose = lookup.propose

    def forced(requests):  # noqa: ANN001, ANN202
        (r,) = requests  # the planner asks for one sequence at a time
        if int(r.seq.request_id.rsplit("-", 1)[-1]) % 2:  # LLM.generate names requests gen-N
            return Proposal([[2, 0, 2][: r.max_drafts]], None)
        return propose(requests)

    lookup.propose = forced


def record_mixed_batches(llm: LLM) -> list[int]:
    """Counts the draft steps whose batch holds proposals from two or more sources."""
    drafting, mixed = llm.engine.drafting, [0]
    propose = drafting.propose

    def spy(scheduled, vocab):  # noqa: ANN001, ANN202
        drafts = propose(scheduled, vocab)
        mixed[0] += len({s.seq.draft.source for s, t in zip(scheduled, drafts.tokens) if t}) >= 2
        return drafts

    drafting.propose = spy
    return mixed


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Cells with expected count < 5 are pooled into one bin, as the test requires."""
    expected = probs.ravel() * counts.sum()
    observed = counts.ravel()
    assert observed[expected == 0].sum() == 0, "sampled a sequence the target gives probability 0"
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


# Every source under every setting; the hybrid with an EAGLE head (whose own q rows the "eagle" cases cover)
# and the early exit through an exit head (whose reduced vocabulary they cover too) at temperature 1 only, to
# keep the suite's time.
CASES = [(m, s) for m in ("draft_model", "ngram", "suffix", "hybrid", "self", "hybrid+self", "eagle") for s in SETTINGS]
CASES += [("hybrid+eagle", "temperature=1"), ("self+exit", "temperature=1")]


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "seeded"])
@pytest.mark.parametrize(("method", "setting"), CASES)
def test_sampled_tokens_follow_the_target_distribution(method, setting, seeded, pair):
    """"self": the target's first layer drafts; "hybrid+self": the draft model's and the early layers' real
    q rows and the lookup's one-hot ones side by side in the same steps; "eagle": an EAGLE-3 head over a
    reduced vocabulary (q = 0 at two tokens), "hybrid+eagle" beside the lookup; "self+exit": the first layer
    through an exit head over 6 tokens."""
    target, draft = pair
    params = SETTINGS[setting]
    if method.endswith("eagle"):
        draft = draft.parent / "eagle"
    llm = LLM(
        model=str(target.parent / "target-exit" if method == "self+exit" else target),
        draft_model=str(draft) if method.split("+")[0] not in ("ngram", "suffix", "self") else None,
        draft_layers=1 if "self" in method else None, speculative_method=method.split("+")[0],
        num_speculative_tokens=3, dtype="float32", **SAMPLED_ENGINE, max_num_seqs=512, max_num_batched_tokens=4096,
        seed=1234,
    )
    mixed = record_mixed_batches(llm)
    drafter_mixes = alternate_drafters(llm) if method == "hybrid+self" else set()
    if method.startswith("hybrid"):
        route_half_to_lookup(llm)
    counts = engine_samples(llm, seeded, **params)
    if method.startswith("hybrid"):
        assert mixed[0] > 0, "no step mixed lookup and drafter proposals"
    if method == "hybrid+self":
        assert frozenset({"draft_model", "self"}) in drafter_mixes, "no step mixed the two drafters"
    stats = llm.stats()
    # Both the accept and the reject paths must have run, hundreds of times each (~24,000 drafts), or the test
    # proves little. (The random EAGLE head's top-p nucleus leaves out the target's favourite token: 0.03.)
    assert 0.02 < stats.acceptance_rate < 0.95, f"acceptance {stats.acceptance_rate:.2f}: q too close to or far from p"
    p = chi_square_p(counts, exact_joint(target, **params))
    label = f"{method}/{setting}/{'seeded' if seeded else 'rejection'}"
    assert p > 1e-3, f"{label}: chi-square p-value {p:.2e}: samples are not distributed as the target"


@pytest.mark.parametrize("method", ["draft_model", "hybrid"])
def test_sampled_tokens_across_the_plain_fast_path_follow_the_target_distribution(method, pair):
    """Adaptive k, the goodput controller turning speculation off and on every other step: the steps without
    any speculative work and the catch-ups after them keep the target's distribution."""
    target, draft = pair
    llm = LLM(model=str(target), draft_model=str(draft), speculative_method=method, dtype="float32", **SAMPLED_ENGINE,
              max_num_seqs=512, max_num_batched_tokens=4096, seed=4321)
    modes = flip_plain_and_speculative(llm.engine)
    counts = engine_samples(llm, False, temperature=1.0)
    assert modes.get("plain", 0) + modes.get("probe", 0) > 0 and modes.get("speculate", 0) > 0, modes
    stats = llm.stats()
    assert stats.num_draft_tokens > 1000 and 0.02 < stats.acceptance_rate < 0.95, "both paths, many times"
    p = chi_square_p(counts, exact_joint(target, temperature=1.0))
    assert p > 1e-3, f"{method}/flipping: chi-square p-value {p:.2e}: samples are not distributed as the target"


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_sampled_tokens_with_rows_cut_after_an_unsure_draft_follow_the_target_distribution(method, pair, monkeypatch):
    """--draft-confidence at the median of the probabilities the drafter gave its own drafts: rows that stop
    after an unsure draft beside rows that draft all three, and the samples keep the target's law."""
    target, draft = pair
    llm = LLM(model=str(target), draft_model=str(draft.parent / "eagle" if method == "eagle" else draft),
              speculative_method=method, num_speculative_tokens=3, draft_confidence=1e-9, dtype="float32",
              **SAMPLED_ENGINE, max_num_seqs=512, max_num_batched_tokens=4096, seed=2468)
    stats = llm.stats()  # the engine's running totals
    cut_at_the_median(llm, lambda: llm.generate([PROMPT] * 500, SamplingParams(max_tokens=4, ignore_eos=True,
                                                                                temperature=1.0)), monkeypatch)
    uncut = stats.num_draft_tokens / stats.num_drafts  # the warm-up's, with a confidence nothing is under
    before = stats.num_drafts, stats.num_draft_tokens
    counts = engine_samples(llm, False, temperature=1.0)
    per_step = (stats.num_draft_tokens - before[1]) / (stats.num_drafts - before[0])
    assert 1.0 < per_step < uncut - 0.1, f"{per_step:.2f} drafts a sequence-step against {uncut:.2f} uncut"
    p = chi_square_p(counts, exact_joint(target, temperature=1.0))
    assert p > 1e-3, f"{method}/cut: chi-square p-value {p:.2e}: samples are not distributed as the target"


def test_chi_square_detects_the_drafts_own_distribution(pair):
    """Power check: samples of the draft model alone must fail the same test against the target."""
    target, draft = pair
    llm = LLM(model=str(draft), speculative_method="none", dtype="float32", **SAMPLED_ENGINE, max_num_seqs=512, seed=5)
    counts = engine_samples(llm, temperature=1.0)
    assert chi_square_p(counts, exact_joint(draft, temperature=1.0)) > 1e-3  # the draft matches itself
    # and not the target: a sample the target gives probability 0 says so outright (on an AVX2 host the draft
    # drew some; chi_square_p refuses them, as a lossless test must), else the test's p-value does
    target_joint = exact_joint(target, temperature=1.0)
    impossible = counts.ravel()[target_joint.ravel() == 0].sum()
    assert impossible > 0 or chi_square_p(counts, target_joint) < 1e-6

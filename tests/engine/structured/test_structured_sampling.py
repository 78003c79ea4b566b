"""Sampled output under a grammar is distributed exactly as the grammar-masked target's.

The target law of a constrained request is the masked one: at each position the target's logits
outside what the grammar allows there are -inf, then temperature / top-k / top-p as usual. An 8-token
vocabulary (seven one-character tokens and EOS) makes that law computable by brute force, here from
the models and the regex's character classes alone (no engine code, no llguidance), so a chi-square
test over many engine samples has real power.

Two regexes: one whose third position is forced ('d'), so the grammar itself drafts it for free
(engine.speculative.forced) and the draft model drafts through it; one with no forced position, so
every draft the draft model proposes from its masked q meets the rejection rule."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

from engine import LLM, SamplingParams
from engine.speculative.source import Proposal
from engine.types.constraint import Constraint
from tests.engine.lossless import reference_transform

LETTERS = "abcdefg"  # token i is LETTERS[i]: the ByteLevel alphabet maps ASCII letters to themselves
EOS = 7
V = 8
PROMPT = [1, 2, 3, 1, 2]
N = 2_000
SCALE = 5.0  # the models' lm_head gain (see _peaky_model)
SEEDS = (31, 32)  # target, draft
# Each regex as the characters (= tokens) it allows position by position.
REGEXES = {
    "forced": ("abc", "abg", "d", "abeg"),
    "free": ("abc", "ab", "abg"),
}
SETTINGS = {
    "temperature=1": dict(temperature=1.0),
    "top_p=0.8": dict(temperature=0.9, top_p=0.8),
}


def regex_of(classes: tuple[str, ...]) -> str:
    return "".join(c if len(c) == 1 else f"[{c}]" for c in classes)


def constraint(name: str) -> Constraint:
    return Constraint.regex(regex_of(REGEXES[name]))


def _tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE over the single letters, no merges: each letter is exactly one token."""
    vocab = {c: i for i, c in enumerate(LETTERS)} | {"<eos>": EOS}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _peaky_model(out: Path, seed: int) -> None:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=EOS,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        # Random tiny models are near-uniform: make p far from it, but not so peaky that one of the few
        # tokens the grammar allows takes all the mass (the masked laws here spread over 15-36 strings).
        model.lm_head.weight.mul_(SCALE)
    model.save_pretrained(out)
    _tokenizer().save_pretrained(out)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("letters8")
    _peaky_model(root / "target", seed=SEEDS[0])
    _peaky_model(root / "draft", seed=SEEDS[1])
    return root / "target", root / "draft"


def test_the_tokenizer_and_regexes_mean_what_the_test_assumes(pair):
    """One token per letter, EOS = 7, and llguidance (through the engine's backend) allows exactly the
    character classes position by position, forces the single-letter ones, and ends after the last."""
    from engine.structured.grammar import GrammarBackend

    target, _ = pair
    tok = AutoTokenizer.from_pretrained(target)
    assert tok.eos_token_id == EOS and len(tok) == V
    assert tok.encode(LETTERS) == list(range(7)) and tok.decode(list(range(7))) == LETTERS
    backend = GrammarBackend(tok, V, (EOS,))
    for name, classes in REGEXES.items():
        state = backend.start(constraint(name))
        for chars in classes:
            bits = int(backend.masks(1, [(state, 0, [])])[0, 0])
            assert [t for t in range(V) if bits >> t & 1] == [LETTERS.index(c) for c in chars], name
            assert state.forced() == ([LETTERS.index(chars)] if len(chars) == 1 else []), name
            assert not state.finished
            state.advance(LETTERS.index(chars[0]))
        assert state.finished, name


@torch.inference_mode()
def exact_joint(model_dir: Path, classes: tuple[str, ...], mode: str = "masked", **params) -> np.ndarray:
    """P(t1 .. tL) of the constrained output, shape [V] * L. "masked", the law the engine must follow:
    each position's logits outside its class are -inf before the transform. Wrong laws, for the power
    checks: "unmasked", the transformed target's own law restricted to the regex's strings and
    renormalised; "truncated first", the transform (top-p) on the unmasked logits, then the mask."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    allowed = [[LETTERS.index(c) for c in chars] for chars in classes]

    def dist(ids: list[int], j: int) -> np.ndarray:
        logits = model(torch.tensor([ids])).logits[0, -1]
        if mode == "masked":
            mask = torch.full_like(logits, float("-inf"))
            mask[allowed[j]] = 0.0
            logits = logits + mask
        p = reference_transform(logits, **params).double().numpy()
        if mode == "truncated first":
            kept = np.zeros_like(p)
            kept[allowed[j]] = p[allowed[j]]
            p = kept / kept.sum() if kept.sum() else kept
        return p

    joint = np.zeros((V,) * len(classes))

    def walk(prefix: list[int], prob: float) -> None:
        j = len(prefix)
        if j == len(classes):
            joint[tuple(prefix)] = prob
            return
        p = dist(PROMPT + prefix, j)
        for t in allowed[j]:
            if p[t] > 0:
                walk(prefix + [t], prob * p[t])

    walk([], 1.0)
    if mode == "masked":
        assert abs(joint.sum() - 1.0) < 1e-6
    return joint / joint.sum()


def engine_samples(llm: LLM, name: str, seeded: bool = False, **params) -> np.ndarray:
    """N constrained continuations: each must be exactly the regex's length and end by the grammar.
    Seeded: every request has its own seed, so it is verified by the shared-noise choice, not rejection."""
    classes = REGEXES[name]
    counts = np.zeros((V,) * len(classes))
    batch = 2000
    for b in range(N // batch):
        plist = [SamplingParams(max_tokens=8, seed=b * batch + i if seeded else None, constraint=constraint(name),
                                **params) for i in range(batch)]
        for out in llm.generate([PROMPT] * batch, plist):
            got = (out.token_ids, out.finish_reason)
            assert len(out.token_ids) == len(classes) and out.finish_reason == "stop", got
            counts[tuple(out.token_ids)] += 1
    return counts


def route_half_to_lookup(llm: LLM) -> None:
    """Half the requests get a fixed "lookup" proposal ("abg", cut by the grammar where it forbids a
    token), so one-hot proposals verify next to the draft model's masked q in the same steps."""
    lookup = llm.engine.drafting.lookup
    propose = lookup.propose

    def fixed(requests):  # noqa: ANN001, ANN202
        (r,) = requests  # the planner asks for one sequence at a time
        if int(r.seq.request_id.rsplit("-", 1)[-1]) % 2:  # LLM.generate names requests gen-N
            return Proposal([[0, 1, 6][: r.max_drafts]], None)
        return propose(requests)

    lookup.propose = fixed


def record_sources(llm: LLM) -> dict[str, int]:
    """Per source, the draft steps where it proposed at least one token; "mixed": steps whose batch
    held proposals from two sources or more."""
    drafting, seen = llm.engine.drafting, {"mixed": 0}
    propose = drafting.propose

    def spy(scheduled, vocab):  # noqa: ANN001, ANN202
        drafts = propose(scheduled, vocab)
        sources = {s.seq.draft.source for s, t in zip(scheduled, drafts.tokens) if t}
        for source in sources:
            seen[source] = seen.get(source, 0) + 1
        seen["mixed"] += len(sources) >= 2
        return drafts

    drafting.propose = spy
    return seen


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Cells with expected count < 5 are pooled into one bin. A sample where the law has probability 0
    is a failure outright (p = 0)."""
    expected = probs.ravel() * counts.sum()
    observed = counts.ravel()
    if observed[expected == 0].sum():
        return 0.0
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def make_llm(target: Path, draft: Path, method: str) -> LLM:
    return LLM(
        model=str(target), draft_model=str(draft), speculative_method=method, num_speculative_tokens=3,
        dtype="float32", device="cpu", max_num_seqs=512, max_num_batched_tokens=4096, seed=1234,
    )


# A half fraction of regex x method x verification x setting: every pair of them meets in some case.
CASES = [
    (name, method, seeded, "top_p=0.8" if (name == "free") ^ (method == "hybrid") ^ seeded else "temperature=1")
    for name in REGEXES for method in ("draft_model", "hybrid") for seeded in (False, True)
]
POWER = [c for c in CASES if c[1] == "draft_model"]


@pytest.fixture(scope="module")
def sampled(pair) -> Callable[..., tuple[np.ndarray, dict[str, int], float]]:
    """Each case's engine samples and what the engine saw, drawn once (the power checks reuse them)."""
    target, draft = pair
    cache: dict = {}

    def get(name: str, method: str, seeded: bool, setting: str) -> tuple[np.ndarray, dict[str, int], float]:
        key = (name, method, seeded, setting)
        if key not in cache:
            llm = make_llm(target, draft, method)
            seen = record_sources(llm)
            if method == "hybrid":
                route_half_to_lookup(llm)
            counts = engine_samples(llm, name, seeded, **SETTINGS[setting])
            cache[key] = counts, seen, llm.stats().acceptance_rate
        return cache[key]

    return get


def _label(name: str, method: str, seeded: bool, setting: str) -> str:
    return f"{name}/{method}/{setting}/{'seeded' if seeded else 'rejection'}"


@pytest.mark.parametrize(("name", "method", "seeded", "setting"), CASES, ids=[_label(*c) for c in CASES])
def test_constrained_samples_follow_the_masked_target(name, method, seeded, setting, pair, sampled):
    target, _ = pair
    counts, seen, rate = sampled(name, method, seeded, setting)
    label = _label(name, method, seeded, setting)
    assert seen.get("draft_model", 0) > 0, f"{label}: the draft model never drafted"
    if name == "forced":
        assert seen.get("grammar", 0) > 0, f"{label}: the grammar never drafted its forced token"
    if method == "hybrid":
        assert seen.get("ngram", 0) > 0, f"{label}: the lookup never drafted"
    if name == "forced" or method == "hybrid":
        assert seen["mixed"] > 0, f"{label}: no step mixed the sources: {seen}"
    # Both the accept and the reject paths must have run, or the test proves little.
    assert 0.05 < rate < 0.95, f"{label}: acceptance {rate:.2f}: q too close to or far from p"
    p = chi_square_p(counts, exact_joint(target, REGEXES[name], **SETTINGS[setting]))
    print(f"{label}: acceptance {rate:.2f}, sources {seen}, chi-square p {p:.3g}")
    assert p > 1e-3, f"{label}: chi-square p-value {p:.2e}: samples are not distributed as the masked target"


@pytest.mark.parametrize(("name", "method", "seeded", "setting"), POWER, ids=[_label(*c) for c in POWER])
def test_chi_square_detects_wrong_laws(name, method, seeded, setting, pair, sampled):
    """Power check: the same samples fail against laws the engine must not follow: the target's
    restricted to the regex's strings without masking, the draft model's masked law, and (truncated)
    top-p applied before the mask instead of after it."""
    target, draft = pair
    counts, _, _ = sampled(name, method, seeded, setting)
    classes, params = REGEXES[name], SETTINGS[setting]
    wrong = {
        "unmasked": exact_joint(target, classes, mode="unmasked", **params),
        "draft": exact_joint(draft, classes, **params),
    }
    if setting != "temperature=1":
        wrong["truncated first"] = exact_joint(target, classes, mode="truncated first", **params)
    ps = {law: chi_square_p(counts, joint) for law, joint in wrong.items()}
    print(f"{_label(name, method, seeded, setting)}: p against wrong laws {ps}")
    assert all(p < 1e-6 for p in ps.values()), ps

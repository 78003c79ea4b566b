"""Greedy output under a grammar equals the grammar-masked target alone, for every drafter, with and
without grammar-forced drafts, alone and in mixed batches, through preemption.

The reference is written independently of the engine: transformers recomputes the whole sequence per
token, llguidance's own matcher gives the mask, and the argmax of the masked logits is the token."""

from __future__ import annotations

from pathlib import Path

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from engine import GRAMMAR_SOURCE, LLM, Constraint, SamplingParams, StepStats
from tests.engine.lossless import NEAR_TIE, Reference, assert_same_as_target, prompts_for
from tests.tiny_models import EOS, VOCAB

MAX_NEW = 32
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["fib", "point", "os"]},
        "size": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind", "size", "tags", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": Constraint.json_schema(SCHEMA),
    "json_object": Constraint.json_object(),
    "regex": Constraint.regex(r"(def|class) [a-z]{1,8}\((self|n|x)?\):"),
    "choice": Constraint.choice(["print(i)", "return fib(n - 1)", "import os"]),
    "lark": Constraint.grammar('start: "x = " NUM ("+" NUM)*\nNUM: /[0-9]{1,3}/'),
}


class MaskedReference:
    """Greedy decoding of the target alone with llguidance's mask applied to each step's logits."""

    def __init__(self, target_dir: Path, tokenizer_dir: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=EOS)
        self._cache: dict[tuple, tuple[list[int], list[float]]] = {}

    @torch.inference_mode()
    def greedy(self, prompt: list[int], constraint: Constraint) -> tuple[list[int], list[float]]:
        """The tokens, and the masked top-2 logit gap at each of them."""
        key = (*prompt, constraint)
        if key not in self._cache:
            matcher = llguidance.LLMatcher(self.tokenizer, constraint.grammar_text())
            assert not matcher.is_error(), matcher.get_error()
            ids, out, gaps = list(prompt), [], []
            while len(out) < MAX_NEW:
                logits = self.model(torch.tensor([ids])).logits[0, -1]
                bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
                logits[torch.from_numpy(bits[:VOCAB] == 0)] = float("-inf")
                top = logits.topk(2).values
                gaps.append(float(top[0] - top[1]))
                token = int(logits.argmax())
                out.append(token)
                ids.append(token)
                if token == EOS:
                    break
                assert matcher.consume_token(token)
                if matcher.is_stopped():
                    break
            self._cache[key] = (out, gaps)
        return self._cache[key]


@pytest.fixture(scope="module")
def masked(model_sets, tokenizer_dir) -> dict[str, MaskedReference]:
    return {arch: MaskedReference(model_sets[arch].target, tokenizer_dir) for arch in ("llama", "mistral", "gpt2")}


def assert_masked_greedy(ref: MaskedReference, prompt: list[int], constraint: Constraint, got: list[int],
                         label: str) -> None:
    want, gaps = ref.greedy(prompt, constraint)
    if got == want:
        return
    j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert j < min(len(got), len(want)), f"{label}: lengths differ with equal prefixes:\n got  {got}\n want {want}"
    assert gaps[j] < NEAR_TIE, (
        f"{label}: diverged at output token {j}, where the masked top-2 gap is {gaps[j]:.3g} (not a near-tie)"
        f"\n got  {got}\n want {want}"
    )


def requests(prompts: list[list[int]]) -> list[tuple[list[int], str | None]]:
    """Every prompt with every constraint in turn, and one unconstrained request in the same batch."""
    names = list(CONSTRAINTS)
    return [(p, names[i % len(names)]) for i, p in enumerate(prompts)] + [(prompts[0], None)]


def run(llm: LLM, ref: MaskedReference, plain: Reference, prompts: list[list[int]], label: str) -> None:
    batch = requests(prompts)
    singles = [[r] for r in batch[: len(CONSTRAINTS)]]
    for group in [*singles, batch]:
        params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                 constraint=CONSTRAINTS[name] if name else None) for _, name in group]
        outs = llm.generate([p for p, _ in group], params)
        for (prompt, name), out in zip(group, outs):
            where = f"{label} {name} batch={len(group)}"
            if name is None:
                assert_same_as_target(plain, prompt, out.token_ids, where)
            else:
                assert_masked_greedy(ref, prompt, CONSTRAINTS[name], out.token_ids, where)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks, f"{label}: blocks leaked"


SETTINGS = {
    "none": dict(speculative_method="none"),
    "draft_model/k=4": dict(speculative_method="draft_model", num_speculative_tokens=4),
    "draft_model/k=4/no-grammar-drafts": dict(speculative_method="draft_model", num_speculative_tokens=4,
                                              grammar_drafts=False),
    "ngram/k=4": dict(speculative_method="ngram", num_speculative_tokens=4),
    "hybrid/adaptive": dict(speculative_method="hybrid"),
    "self/k=4": dict(speculative_method="self", draft_layers=1, num_speculative_tokens=4),
}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_greedy_under_a_grammar_equals_the_masked_target_alone(arch, setting, model_sets, masked, tokenizer_dir):
    ms, kw = model_sets[arch], SETTINGS[setting]
    llm = LLM(model=str(ms.target), draft_model=str(ms.draft) if "draft_model" in setting or "hybrid" in setting
              else None, dtype="float32", device="cpu", block_size=4, **kw)
    steps = record_steps(llm)
    run(llm, masked[arch], Reference(ms.target), prompts_for(tokenizer_dir), f"{arch}/{setting}")
    stats = llm.stats()
    if setting != "none":
        assert stats.num_draft_tokens > 0, "nothing was drafted: the test proved nothing"
    if kw.get("grammar_drafts", True) and setting != "none":
        assert stats.num_forced_draft_tokens > 0, "the grammar forced nothing that was drafted"
        # A forced draft is certain under the masked target unless a drafter's own draft before it was rejected
        # (it is then lost with it), so one that begins a sequence's drafts is always accepted. How often the
        # drafter's own are rejected is the drafter's business (the adaptive plan follows timings), so the totals
        # prove nothing; the first position of each step does.
        begun = [s for step in steps for s in step.by_source if s.name == GRAMMAR_SOURCE and s.num_drafts]
        assert begun, "no step began with forced drafts: the test proved nothing"
        began = sum(s.num_drafts for s in begun)
        accepted_first = sum(s.accepted_per_position[0] for s in begun)
        assert accepted_first == began, f"{began - accepted_first} of {began} leading forced drafts were rejected"
    else:
        assert stats.num_forced_draft_tokens == 0


def record_steps(llm: LLM) -> list[StepStats]:
    """Every StepStats the engine adds to its totals, in order."""
    steps: list[StepStats] = []
    totals = llm.engine.spec_stats
    add = totals.add

    def spy(step: StepStats, sign: int = 1) -> None:
        steps.append(step)
        add(step, sign)

    totals.add = spy  # type: ignore[method-assign]
    return steps


def test_structured_requests_survive_preemption(model_sets, masked, tokenizer_dir):
    """19 blocks of 4 tokens: eight structured requests at once must preempt, and their matchers,
    which preemption does not touch, stay in step with their tokens."""
    ms = model_sets["llama"]
    llm = LLM(model=str(ms.target), draft_model=str(ms.draft), num_speculative_tokens=4, dtype="float32",
              device="cpu", max_model_len=64, block_size=4, num_kv_blocks=19)
    engine, names, outs, preempted = llm.engine, list(CONSTRAINTS), {}, 0
    prompts = prompts_for(tokenizer_dir)
    for i, p in enumerate(prompts):
        constraint = CONSTRAINTS[names[i % len(names)]]
        engine.add_request(str(i), p, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, constraint=constraint))
        outs[str(i)] = []
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].extend(out.new_token_ids)
        preempted += engine.last_step.num_preempted if engine.last_step else 0
    assert preempted > 0, "nothing was preempted"
    for i, p in enumerate(prompts):
        assert_masked_greedy(masked["llama"], p, CONSTRAINTS[names[i % len(names)]], outs[str(i)], f"request {i}")

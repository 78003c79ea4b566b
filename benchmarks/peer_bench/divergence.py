"""Where a system's greedy text differs from the baseline's, and whether the target's logits excuse it.

Greedy output must not depend on the system, except where the target's top-2 logits are so close that
the summation order of one kernel against another flips the argmax (design.md: near-ties). Each
difference is judged by the target alone, in float32 on the CPU: the first token at which the two texts
differ, and the top-2 logit gap of the target there. A conversation's later turns resend the earlier
turns' outputs, so once one turn differs the later ones were sent different prompts: they are counted
as following it, not judged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.core.audit import NEAR_TIE  # the server's own audit's float32 threshold

from .workload import Conversation, Item, as_request, requests_in


def sent_prompts(batch: list[Item], texts: list[str | None]) -> list[str | None]:
    """The prompt of every request a run sent, in result order (a conversation's turns in turn order)."""
    out: list[str | None] = []
    i = 0
    for item in batch:
        if not isinstance(item, Conversation):
            out.append(as_request(item).prompt)
            i += 1
            continue
        prompt: str | None = item.first
        for _ in range(requests_in(item)):
            out.append(prompt)
            text = texts[i]
            prompt = None if prompt is None or text is None else item.next_prompt(prompt, text)
            i += 1
    return out


def differences(prompts: list[str | None], texts: list[str | None], base_prompts: list[str | None],
                base_texts: list[str | None]) -> list[dict]:
    """The requests whose text differs from the baseline's: judged later when sent the same prompt as the
    baseline's, else marked as following an earlier difference."""
    out = []
    for i, (p, t, bp, bt) in enumerate(zip(prompts, texts, base_prompts, base_texts, strict=True)):
        if t is None or bt is None or t == bt:
            continue
        same_prompt = p is not None and p == bp
        out.append({"index": i, "kind": "unjudged" if same_prompt else "follows an earlier difference",
                    "prompt": p if same_prompt else None, "text": t, "baseline_text": bt})
    return out


@dataclass
class Judge:
    """The target alone, in float32 on the CPU, deciding whether each difference sits on a near-tie."""

    target_dir: Path

    def __post_init__(self) -> None:
        self.tok = AutoTokenizer.from_pretrained(self.target_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.target_dir, dtype=torch.float32).eval()

    def __call__(self, case: dict) -> None:
        """Fills in the first differing token and the target's logits there; kind becomes near-tie or
        unexplained. The target's own greedy tokens find the token: a text's tokens are not recoverable from
        it (re-encoding merges differently), and a prefix encoded otherwise is a context the target never saw."""
        if case["kind"] != "unjudged":
            return
        a, b = case["text"], case["baseline_text"]
        prompt = self.tok.encode(case["prompt"])
        longest = max(len(self.tok.encode(t, add_special_tokens=False)) for t in (a, b))
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=longest + 16, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True,
                                      pad_token_id=self.tok.eos_token_id)
        ids = out.sequences[0, len(prompt):].tolist()
        eos = self.tok.eos_token_id
        for j in range(len(ids)):
            text = self.tok.decode(ids[: j + 1], skip_special_tokens=True)
            ended = ids[j] == eos
            on_a = a.startswith(text) and (not ended or len(a) == len(text))
            on_b = b.startswith(text) and (not ended or len(b) == len(text))
            if not (on_a and on_b):  # at the end of one text at the latest: the two differ
                break
        else:  # the target ran out of tokens before the texts parted
            case.update({"kind": "unexplained", "token": None, "follows": "both"})
            return
        top = torch.topk(out.logits[j][0].float(), 2).values  # the logits at the first token the texts part at
        gap = float(top[0] - top[1])
        case.update({"token": j, "top2_gap": gap, "follows": "text" if on_a else "baseline" if on_b else "neither",
                     "kind": "near-tie" if gap < NEAR_TIE else "unexplained"})


def judge_rows(rows: list[dict], target_dir: Path) -> None:
    """Judges every row's differences in place, loading the target once and only if there are any."""
    cases = [c for r in rows for c in r.get("differences") or () if c["kind"] == "unjudged"]
    if cases:
        judge = Judge(target_dir)
        for c in cases:
            judge(c)

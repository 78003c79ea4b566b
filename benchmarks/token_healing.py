"""Token healing on the embedded pair, for prompts that end at a line end.

The pair's tokenizer merges a newline with the next line's indentation ("\\n    " is one token), so a
prompt ending in a bare "\\n" stops at a boundary the model never saw in training. With healing the
engine backs that token off and lets the model re-spell it. Held-out code snippets (the peer bench's),
cut to end with "\\n"; greedy, hybrid speculation, all prompts in one batch; each mode runs twice,
alternating, and the second round is reported (the first warms caches up).

Measured per mode: acceptance (accepted / drafted), tokens/s, and two code-quality proxies:
  - nll/token: the target's mean negative log-likelihood per token of the continuation, scored on the
    natural tokenization of prompt + completion text after the prompt's last complete token (the
    prompt minus its final newline): lower is text more like what the model expects;
  - indent ok: the completion's first line is indented as Python allows after the prompt's last line
    (a multiple of 4, deeper by 4 after a colon, never deeper otherwise);
  - compiles: of the prompts that compile as an unfinished program (one cut from a class body read
    inside an ``if True:`` block), the fraction still compiling (or
    incomplete) with the completion's first two lines added (codeop.compile_command).
Writes benchmarks/results/token_healing.json.
"""

from __future__ import annotations

import codeop
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402
from peer_bench.prompts import _snippets  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

PAIR = ROOT / "models" / "default"
N_PROMPTS, PROMPT_TOKENS, MAX_NEW = 16, 96, 64
OUT = ROOT / "benchmarks" / "results" / "token_healing.json"


def indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def indent_ok(prompt: str, text: str) -> bool:
    last = next(line for line in reversed(prompt.rstrip("\n").split("\n")) if line.strip())
    first = text.split("\n", 1)[0]
    if not first.strip():
        return False  # a blank line or nothing: no statement to judge
    got, before = indent(first), indent(last)
    if got % 4:
        return False
    return got == before + 4 if last.rstrip().endswith(":") else got <= before


def compiles(source: str) -> bool:
    """Valid so far: complete, or a prefix of a valid program (codeop says "incomplete"). A snippet cut
    from a class body starts indented: it is read inside an ``if True:`` block."""
    if source.startswith(" "):
        source = "if True:\n" + source
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            codeop.compile_command(source, symbol="exec")
        except (SyntaxError, ValueError, OverflowError):
            return False
    return True


@torch.inference_mode()
def nll_per_token(model, tok, prompt: str, text: str) -> float:
    ctx = prompt[:-1]  # ends at a whole token (the snippets end mid-line; the "\n" is the prompt's last token)
    ctx_ids, full = tok.encode(ctx), tok.encode(ctx + "\n" + text)
    start = next((i for i, (a, b) in enumerate(zip(ctx_ids, full)) if a != b), len(ctx_ids))
    logits = model(torch.tensor([full])).logits[0].float()  # [T, V]
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(full[1:])[:, None])[:, 0]  # [T - 1]
    return -logp[start - 1 :].mean().item()


def run(llm: LLM, prompts: list[str], healing: bool) -> dict:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, token_healing=healing)
    s0 = llm.stats()
    drafted, accepted = s0.num_draft_tokens, s0.num_accepted_tokens
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    s1 = llm.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "texts": [o.text for o in outs],
        "acceptance": (s1.num_accepted_tokens - accepted) / max(1, s1.num_draft_tokens - drafted),
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
        "seconds": seconds,
    }


def main() -> None:
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(PAIR / "target")
    prompts = [s + "\n" for s in _snippets(tok, N_PROMPTS, PROMPT_TOKENS)]
    llm = LLM(model=str(PAIR / "target"), draft_model=str(PAIR / "draft"), speculative_method="hybrid",
              dtype="float32")
    modes = {"without healing": False, "with healing": True}
    results: dict[str, dict] = {}
    for _round in range(2):
        for name, healing in modes.items():
            results[name] = run(llm, prompts, healing)
    scorer = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32).eval()
    valid_prompts = [i for i, p in enumerate(prompts) if compiles(p)]
    rows = {}
    for name, r in results.items():
        texts = r["texts"]
        rows[name] = {
            "acceptance": round(r["acceptance"], 4),
            "tokens_per_s": round(r["tokens_per_s"], 1),
            "nll_per_token": round(statistics.mean(nll_per_token(scorer, tok, p, t)
                                                   for p, t in zip(prompts, texts)), 4),
            "indent_ok": round(sum(indent_ok(p, t) for p, t in zip(prompts, texts)) / len(prompts), 4),
            "compiles": round(sum(compiles(prompts[i] + "\n".join(texts[i].split("\n")[:2]))
                                  for i in valid_prompts) / max(1, len(valid_prompts)), 4),
            "tokens": r["tokens"],
            "seconds": round(r["seconds"], 2),
            "first_lines": [t.split("\n", 1)[0] for t in texts[:4]],
        }
    print(f"{len(prompts)} prompts ending in a newline, {MAX_NEW} new tokens, greedy, hybrid; "
          f"compiles over the {len(valid_prompts)} prompts that compile on their own")
    print(f"{'mode':<16} {'acceptance':>10} {'tok/s':>7} {'nll/token':>9} {'indent ok':>9} {'compiles':>8}")
    for name, row in rows.items():
        print(f"{name:<16} {row['acceptance']:>10.1%} {row['tokens_per_s']:>7.1f} {row['nll_per_token']:>9.3f} "
              f"{row['indent_ok']:>9.0%} {row['compiles']:>8.0%}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "setup": {"prompts": len(prompts), "prompt_tokens": PROMPT_TOKENS, "max_new_tokens": MAX_NEW,
                  "method": "hybrid", "greedy": True, "compile_prompts": len(valid_prompts)},
        "results": rows,
    }, indent=2) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

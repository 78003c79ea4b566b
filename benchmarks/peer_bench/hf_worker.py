"""transformers' own generate() as a benchmark system, in a child process that stays up between runs.

    python benchmarks/peer_bench/hf_worker.py --target DIR --mode assisted --draft DIR

Reads one JSON line per run ({"prompts": [...], "max_new_tokens": N}) on stdin, answers one JSON line
with a result per prompt: wall time to the first new token (TTFT) and to the end, the text, the new
tokens, and how many forwards the target and the assistant ran. Batch 1 only: assisted generation and
prompt lookup take one sequence at a time. Greedy, transformers' defaults otherwise (what a user gets).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value; it has no default


class Timing(BaseStreamer):
    """generate() calls put() with the prompt first, then with each batch of new tokens."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def count_forwards(model: torch.nn.Module) -> list[int]:
    counter = [0]
    model.register_forward_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
    return counter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--mode", choices=("plain", "assisted", "lookup"), required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32  # as specd's dtype=auto
    tok = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(args.device).eval()
    target_calls = count_forwards(target)
    extra: dict = {}
    draft_calls = [0]
    if args.mode == "assisted":
        draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).to(args.device).eval()
        draft_calls = count_forwards(draft)
        extra["assistant_model"] = draft
    elif args.mode == "lookup":
        extra["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        results = []
        for prompt in job["prompts"]:
            ids = tok(prompt, return_tensors="pt").input_ids.to(args.device)
            streamer = Timing()
            t_calls, d_calls = target_calls[0], draft_calls[0]
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=job["max_new_tokens"], streamer=streamer,
                                      pad_token_id=tok.eos_token_id, **extra)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            new = out[0, ids.shape[1]:].tolist()
            results.append({
                "ttft": (streamer.first or t1) - t0, "latency": t1 - t0, "tokens": len(new),
                "text": tok.decode(new, skip_special_tokens=True),
                "target_forwards": target_calls[0] - t_calls, "draft_forwards": draft_calls[0] - d_calls,
            })
        print(json.dumps({"results": results}), flush=True)


if __name__ == "__main__":
    main()

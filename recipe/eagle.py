"""`specd distill --method eagle`: train an EAGLE-3 head for any transformers causal LM on its own hidden states.

Online: every batch runs the frozen target (no grad, output_hidden_states) for its three aux layers and its
next-token distribution; the head learns with the training-time test of recipe/eagle_ttt.py. The head shares
the target's input embedding (not saved) and is written in the published EAGLE-3 layout by save_head.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, PretrainedConfig

from engine import Eagle3Head, aux_layer_ids, save_head
from recipe.data import random_windows
from recipe.distill import param_count, pick_device
from recipe.eagle_ttt import STEP_DECAY, ttt_agreement, ttt_forward, ttt_losses, weighted_loss
from recipe.frozen_target import TrainJob, choose_draft_vocab, load_frozen, tokenize
from recipe.train import TrainResult, train

logger = logging.getLogger("recipe")


@dataclass(frozen=True)
class EagleSetup:
    ttt_steps: int = 3  # chain steps trained per window, step 0 (target-fed) included
    draft_vocab: int | None = None  # None: sized by coverage (recipe/draft_vocab.py)
    aux_layers: tuple[int, int, int] | None = None  # None: default_aux_layers
    seq_len: int = 512  # window length the target reads; the head trains on seq_len - 1 positions
    batch_size: int = 8
    seed: int = 0
    eval_windows: int = 32

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be >= 1, got {self.draft_vocab}")
        if self.aux_layers is not None and len(self.aux_layers) != 3:
            raise ValueError(f"aux_layers must name 3 layers, got {self.aux_layers}")
        if self.seq_len < self.ttt_steps + 1 or self.batch_size < 1:
            raise ValueError(f"seq_len must exceed ttt_steps and batch_size be >= 1 ({self.seq_len}, "
                             f"{self.batch_size})")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default (low, middle, high: inputs of layers 2, n/2, n-3) where those are distinct, else the
    inputs of layers 1, n/2 and n-1 (a 6-layer target: 1, 3, 5)."""
    low, mid, high = 2, num_layers // 2, num_layers - 3
    if low < mid < high:
        return low, mid, high
    return tuple(min(i, num_layers - 1) for i in (1, num_layers // 2, num_layers - 1))  # type: ignore[return-value]


def eagle_config(target: PretrainedConfig, draft_size: int, aux: tuple[int, ...]) -> LlamaConfig:
    """One Llama decoder layer as wide as the target, with the target's MLP width, heads and rotary."""
    text = target.get_text_config()
    h, heads = text.hidden_size, text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    return LlamaConfig(
        vocab_size=text.vocab_size,
        hidden_size=h,
        intermediate_size=getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * h,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or h // heads,
        max_position_embeddings=getattr(text, "max_position_embeddings", 2048),
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        rope_parameters=dict(rope),
        tie_word_embeddings=False,
        draft_vocab_size=draft_size,
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux)},
        bos_token_id=getattr(text, "bos_token_id", None),
        eos_token_id=getattr(text, "eos_token_id", None),
        pad_token_id=getattr(text, "pad_token_id", None),
    )


@torch.no_grad()
def target_pass(target: torch.nn.Module, windows: torch.Tensor, aux: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """windows [B, L] -> (tokens [B, L-1]: x_{t+1} at t, aux hidden [B, L-1, 3H]: h_t at t, logits
    [B, L-1, V]: the target's logits at t + 1, its distribution for x_{t+2})."""
    out = target(input_ids=windows, output_hidden_states=True)
    hidden = torch.cat([out.hidden_states[i] for i in aux], dim=-1)  # [B, L, 3H]
    return windows[:, 1:], hidden[:, :-1], out.logits[:, 1:].float()


def train_eagle(job: TrainJob, setup: EagleSetup) -> TrainResult:
    target_path, out, corpus, cfg, held_out = job.target_path, job.out, job.corpus, job.cfg, job.held_out
    dev = pick_device(job.device)
    tokenizer, target, saved_dtype = load_frozen(target_path, dev, job.trust_remote_code)
    text = target.config.get_text_config()
    vocab, num_layers = text.vocab_size, text.num_hidden_layers
    aux = setup.aux_layers or default_aux_layers(num_layers)
    seq_len = min(setup.seq_len, getattr(text, "max_position_embeddings", setup.seq_len))

    t0 = time.perf_counter()
    data = tokenize(corpus, held_out, tokenizer, seq_len, setup.eval_windows, dev)
    stream, eval_split, windows = data.stream, data.eval_split, data.windows
    logger.info("eagle: %d corpus files, %d tokens; %d %s eval windows (tokenized in %.1fs)", len(corpus),
                stream.numel(), windows.shape[0], eval_split, time.perf_counter() - t0)
    size, table, draft_ids, covered = choose_draft_vocab(lambda w: target_pass(target, w, aux)[2], data, vocab,
                                                         setup.draft_vocab, "eagle")

    torch.manual_seed(setup.seed)
    config = eagle_config(target.config, size, aux)
    aux_layer_ids(config, num_layers)  # the checks the engine applies when it loads the head
    head = Eagle3Head(config, text.hidden_size).to(dev)
    head.share_embeddings(target.get_input_embeddings())
    head.set_draft_vocab(draft_ids)
    output = target.get_output_embeddings()
    if output is not None and output.weight.shape[1] == config.hidden_size:
        with torch.no_grad():  # start the draft lm_head from the target's own rows for those tokens
            head.lm_head.weight.copy_(output.weight[draft_ids].float())
    logger.info("eagle: target %s (%.1fM params, aux layers %s) -> head %.2fM params, %d TTT steps, on %s",
                target_path, param_count(target) / 1e6, list(aux), param_count(head) / 1e6, setup.ttt_steps, dev)

    history: list[list[float]] = []  # per optimizer step: the loss at each chain step

    def loss_fn(model: Eagle3Head, batch: torch.Tensor) -> torch.Tensor:
        tokens, hidden, logits = target_pass(target, batch, aux)
        outs = ttt_forward(model, tokens, model.fuse(hidden), setup.ttt_steps)
        losses = ttt_losses(model, outs, logits, draft_ids)
        history.append([loss.item() for loss in losses])
        return weighted_loss(losses)

    evals: list[dict[str, object]] = []

    def evaluate() -> float:
        agree = [[0, 0] for _ in range(setup.ttt_steps)]
        with torch.no_grad():
            for i in range(0, windows.shape[0], 8):
                tokens, hidden, logits = target_pass(target, windows[i : i + 8], aux)
                outs = ttt_forward(head, tokens, head.fuse(hidden), setup.ttt_steps)
                for s, (a, n) in enumerate(ttt_agreement(head, outs, logits, draft_ids)):
                    agree[s][0] += a
                    agree[s][1] += n
        by_step = [round(a / n, 4) for a, n in agree]
        evals.append({"step": len(history), "agreement": by_step})
        logger.info("eagle step %d  %s agreement by chain step %s", len(history), eval_split,
                    "  ".join(f"{a:.4f}" for a in by_step))
        return by_step[0]

    batches = (b.to(dev) for b in random_windows(stream, setup.batch_size, seq_len - 1, setup.seed))
    result = train(head, batches, loss_fn, cfg, evaluate=evaluate, what="eagle")

    tail = history[-max(1, len(history) // 10):]  # the last tenth of training, per chain step
    record = {
        "target": str(target_path), "method": "eagle3", "aux_layers": list(aux), "ttt_steps": setup.ttt_steps,
        "step_weights": [round(STEP_DECAY**s, 6) for s in range(setup.ttt_steps)],
        "draft_vocab_size": size, "vocab_size": vocab, "draft_vocab_from": "corpus token frequency",
        "draft_vocab_coverage": {"split": eval_split, "tokens": covered,
                                 "by_size": {str(n): round(c, 4) for n, c in table.items()}},
        "train": asdict(cfg), "seq_len": seq_len, "batch_size": setup.batch_size, "seed": setup.seed,
        "device": str(dev), "threads": torch.get_num_threads(), "params": param_count(head),
        "tokens": result.tokens, "seconds": round(result.seconds, 1), "final_loss": result.final_loss,
        "final_loss_by_step": [round(sum(h[s] for h in tail) / len(tail), 4) for s in range(setup.ttt_steps)],
        "loss_curve": _curve(history, cfg.log_every),
        "eval_split": eval_split, "eval_windows": list(windows.shape), "agreement": evals,
        "corpus": {"name": job.corpus_name, "files": len(corpus), "tokens": stream.numel(),
                   "held_out_files": len(held_out or []), "held_out_tokens": data.eval_tokens if held_out else 0},
    }
    save(head, out, record, saved_dtype)
    return result


def _curve(history: list[list[float]], every: int) -> list[list[float]]:
    """[[step, mean weighted loss over the `every` steps ending there], ...], as the progress lines log it."""
    totals = [sum(STEP_DECAY**s * loss for s, loss in enumerate(h)) for h in history]
    return [[min(i + every, len(totals)), round(sum(totals[i : i + every]) / len(totals[i : i + every]), 4)]
            for i in range(0, len(totals), every)]


def save(head: Eagle3Head, out: Path, record: dict[str, object], dtype: torch.dtype | str | None) -> None:
    """The published layout (config.json, model.safetensors) in the target's saved dtype, plus training.json."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if dtype in (torch.bfloat16, torch.float16):
        head.to(dtype)
        head.config.dtype = dtype
    save_head(head, out)
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    logger.info("eagle: saved head to %s", out)

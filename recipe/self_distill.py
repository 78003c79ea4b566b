"""`specd distill --method self`: train the target's early exit to draft (self-speculation).

Two parts, both online against the target's own next-token distribution p (no labels needed):

- an exit head (engine.models.exit_head): a linear readout over a reduced draft vocabulary, placed where
  the LM head was after the target's first L layers and its final norm, fitted by soft cross-entropy
  H(p restricted to the draft vocabulary, q_exit). The target itself is untouched, so its quality is too.
- with ``tune_layers``, also layers [0, L) of the target, by the early-exit loss plus ``quality_weight`` x
  KL(p_original || p_tuned) of the full model against a frozen copy of itself (what keeps the target's own
  output close; the change in held-out bits per byte is measured before and after and written down).

The output directory is the target's checkpoint with the head in ``exit_head/``: the target's files copied
(or, tuned, rewritten) beside it, so ``--model OUT --speculative-method self`` serves it.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from engine import ExitHead, decoder_layers, exit_head, truncate
from recipe.data import random_windows
from recipe.distill import param_count, pick_device
from recipe.frozen_target import TrainJob, choose_draft_vocab, load_frozen, tokenize
from recipe.objectives import bits_per_byte
from recipe.train import TrainResult, train

logger = logging.getLogger("recipe")


@dataclass(frozen=True)
class SelfSetup:
    exit_layers: int | None = None  # None: a third of the target's layers (the engine's default)
    draft_vocab: int | None = None  # None: sized by coverage (recipe/draft_vocab.py)
    tune_layers: bool = False  # also fine-tune layers [0, exit_layers) of the target
    quality_weight: float = 1.0  # weight of KL(p_original || p_tuned) when tuning layers
    seq_len: int = 512
    batch_size: int = 8
    seed: int = 0
    eval_windows: int = 32

    def __post_init__(self) -> None:
        if self.exit_layers is not None and self.exit_layers < 1:
            raise ValueError(f"exit_layers must be >= 1, got {self.exit_layers}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be >= 1, got {self.draft_vocab}")
        if self.quality_weight < 0 or self.seq_len < 2 or self.batch_size < 1:
            raise ValueError(f"quality_weight must be >= 0, seq_len >= 2, batch_size >= 1 ({self.quality_weight}, "
                             f"{self.seq_len}, {self.batch_size})")


class EarlyExit(torch.nn.Module):
    """The target's first L layers and final norm (shared modules), then the exit head: the engine's draft."""

    def __init__(self, target: torch.nn.Module, num_layers: int, head: ExitHead) -> None:
        super().__init__()
        short = truncate(target, num_layers, head.exit_layers)
        self.decoder = getattr(short, short.base_model_prefix)
        self.layers = decoder_layers(short, head.exit_layers)  # the target's own first layers
        self.head = head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] -> draft logits over the draft vocabulary [B, T, N]."""
        hidden = self.decoder(input_ids=input_ids).last_hidden_state  # [B, T, H], after the final norm
        return self.head.draft_logits(hidden).float()


def exit_loss(q_logits: torch.Tensor, p_logits: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """H(p, q) averaged over positions, p the target's distribution restricted to the draft vocabulary and
    renormalised. q_logits [B, T, N], p_logits [B, T, V], draft_ids [N] sorted target ids."""
    p = F.softmax(p_logits[..., draft_ids].float(), dim=-1)  # [B, T, N]
    return -(p * F.log_softmax(q_logits, dim=-1)).sum(-1).mean()


def quality_loss(new_logits: torch.Tensor, old_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_old || p_new) averaged over positions, both [B, T, V]."""
    log_p = F.log_softmax(old_logits.float(), dim=-1)
    log_q = F.log_softmax(new_logits.float(), dim=-1)
    return F.kl_div(log_q.flatten(0, 1), log_p.flatten(0, 1), log_target=True, reduction="batchmean")


@torch.no_grad()
def agreement(early: EarlyExit, target: torch.nn.Module, windows: torch.Tensor, draft_ids: torch.Tensor) -> float:
    """Share of positions where the exit's argmax is the target's: its per-token greedy acceptance."""
    agree, total = 0, 0
    for i in range(0, windows.shape[0], 8):
        inputs = windows[i : i + 8]
        top = draft_ids[early(inputs).argmax(-1)]  # [B, T] target ids
        agree += int((top == target(input_ids=inputs).logits.argmax(-1)).sum())
        total += inputs.numel()
    return agree / total


@torch.no_grad()
def bits_per_token(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """Mean cross-entropy in bits of windows[:, 1:] given windows[:, :-1]."""
    nats, n = 0.0, 0
    for i in range(0, windows.shape[0], 8):
        batch = windows[i : i + 8]
        logits = model(input_ids=batch[:, :-1]).logits.float()
        nats += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
        n += batch[:, 1:].numel()
    return nats / n / torch.log(torch.tensor(2.0)).item()


def train_exit(job: TrainJob, setup: SelfSetup, byte_lengths: torch.Tensor | None = None) -> TrainResult:
    """Train the exit head (and with setup.tune_layers the first layers) and write OUT (see the module doc).
    ``byte_lengths`` [V] (bytes each token spells) adds held-out bits per byte to the quality record."""
    target_path, out, corpus, cfg, held_out = job.target_path, job.out, job.corpus, job.cfg, job.held_out
    dev = pick_device(job.device)
    tokenizer, target, saved_dtype = load_frozen(target_path, dev, job.trust_remote_code)
    text = target.config.get_text_config()
    vocab, num_layers, hidden = text.vocab_size, text.num_hidden_layers, text.hidden_size
    layers = setup.exit_layers or max(1, num_layers // 3)
    if not 1 <= layers < num_layers:
        raise ValueError(f"exit_layers must be in [1, {num_layers - 1}] for a target of {num_layers} layers, "
                         f"got {layers}")
    seq_len = min(setup.seq_len, getattr(text, "max_position_embeddings", setup.seq_len))

    data = tokenize(corpus, held_out, tokenizer, seq_len, setup.eval_windows, dev)
    stream, eval_split, windows = data.stream, data.eval_split, data.windows
    logger.info("self: %d corpus files, %d tokens; %d %s eval windows", len(corpus), stream.numel(),
                windows.shape[0], eval_split)
    size, table, draft_ids, covered = choose_draft_vocab(lambda w: target(input_ids=w).logits, data, vocab,
                                                         setup.draft_vocab, "self")

    torch.manual_seed(setup.seed)
    head = ExitHead(hidden, vocab, size, layers).to(dev)
    head.set_draft_vocab(draft_ids)
    with torch.no_grad():  # start from the target's own rows for those tokens: the untrained early exit
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids].float())
    early = EarlyExit(target, num_layers, head)
    original = None
    if setup.tune_layers:
        original = copy.deepcopy(target).eval()  # the frozen reference the quality term holds the target to
        early.layers.requires_grad_(True)
    reference = original if original is not None else target
    # by the target's own names, and the head's under exit_head/
    trained = ([f"exit_head.{n}" for n, _ in head.named_parameters()]
               + [n for n, p in target.named_parameters() if p.requires_grad])
    logger.info("self: target %s (%.1fM params, %d layers) -> exit after %d layers, head %.2fM params%s, on %s",
                target_path, param_count(target) / 1e6, num_layers, layers, param_count(head) / 1e6,
                f", tuning {sum(p.numel() for p in early.parameters() if p.requires_grad) / 1e6:.2f}M params "
                f"of layers [0, {layers})" if setup.tune_layers else "", dev)

    quality: dict[str, float] = {}

    def measure(when: str) -> None:
        quality[f"bits_per_token_{when}"] = round(bits_per_token(target, windows), 5)
        if byte_lengths is not None:
            quality[f"bits_per_byte_{when}"] = round(bits_per_byte(target, windows, byte_lengths.to(dev)), 5)

    if setup.tune_layers:
        measure("before")
    history: list[list[float]] = []

    def loss_fn(model: EarlyExit, batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            p_logits = reference(input_ids=batch).logits  # [B, T, V]
        loss = exit_loss(model(batch), p_logits, draft_ids)
        parts = [loss.item()]
        if setup.tune_layers:
            kl = quality_loss(target(input_ids=batch).logits, p_logits)
            parts.append(kl.item())
            loss = loss + setup.quality_weight * kl
        history.append(parts)
        return loss

    evals: list[dict[str, float]] = []

    def evaluate() -> float:
        value = agreement(early, target, windows, draft_ids)
        evals.append({"step": len(history), "agreement": round(value, 4)})
        return value

    start_agreement = evaluate()
    logger.info("self: %s agreement of the exit with the target before training %.4f", eval_split, start_agreement)
    batches = (b.to(dev) for b in random_windows(stream, setup.batch_size, seq_len - 1, setup.seed))
    result = train(early, batches, loss_fn, cfg, evaluate=evaluate, what="self")
    if setup.tune_layers:
        measure("after")
        logger.info("self: held-out quality of the tuned target %s", quality)

    tail = history[-max(1, len(history) // 10):]
    record = {
        "target": str(target_path), "method": "self", "exit_layers": layers, "num_layers": num_layers,
        "tune_layers": setup.tune_layers, "quality_weight": setup.quality_weight if setup.tune_layers else None,
        "trained": trained, "draft_vocab_size": size, "vocab_size": vocab,
        "draft_vocab_coverage": {"split": eval_split, "tokens": covered,
                                 "by_size": {str(n): round(c, 4) for n, c in table.items()}},
        "train": asdict(cfg), "seq_len": seq_len, "batch_size": setup.batch_size, "seed": setup.seed,
        "device": str(dev), "threads": torch.get_num_threads(), "head_params": param_count(head),
        "tokens": result.tokens, "seconds": round(result.seconds, 1),
        "final_exit_loss": round(sum(h[0] for h in tail) / len(tail), 4),
        "final_quality_kl": round(sum(h[1] for h in tail) / len(tail), 5) if setup.tune_layers else None,
        "exit_loss_curve": [[min(i + cfg.log_every, len(history)),
                             round(sum(h[0] for h in history[i : i + cfg.log_every])
                                   / len(history[i : i + cfg.log_every]), 4)]
                            for i in range(0, len(history), cfg.log_every)],
        "eval_split": eval_split, "eval_windows": list(windows.shape), "agreement": evals, "quality": quality,
        "corpus": {"name": job.corpus_name, "files": len(corpus), "tokens": stream.numel()},
    }
    write(target_path, target if setup.tune_layers else None, tokenizer, head, out, record, saved_dtype)
    return result


def write(target_path: str, tuned: torch.nn.Module | None, tokenizer: object, head: ExitHead, out: Path,
          record: dict[str, object], dtype: torch.dtype | str | None) -> None:
    """OUT: the target's checkpoint (copied, or the tuned weights) with exit_head/ and exit_head/training.json."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(target_path)
    if tuned is not None:
        tuned.to(dtype).save_pretrained(out)
        tokenizer.save_pretrained(out)
        for name in ("generation_config.json", "chat_template.jinja"):
            if (src / name).is_file() and src.resolve() != out.resolve():
                shutil.copy(src / name, out / name)
    elif src.is_dir() and src.resolve() != out.resolve():
        for f in src.iterdir():
            if f.is_file():
                shutil.copy(f, out / f.name)
    elif not src.is_dir():
        AutoModelForCausalLM.from_pretrained(target_path).save_pretrained(out)
        tokenizer.save_pretrained(out)
    exit_head.save(head, out / exit_head.DIR_NAME, dtype)
    (out / exit_head.DIR_NAME / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    logger.info("self: wrote %s with its exit head in %s", out, out / exit_head.DIR_NAME)

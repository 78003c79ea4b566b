"""`specd distill`: train a small draft for any transformers causal LM by distillation (KL to the target).

The draft is a Llama-architecture decoder sharing the target's tokenizer and vocabulary size, so the engine's
draft-model drafter accepts the pair. Its size defaults to a fraction of the target's; flags override it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
)

from recipe.corpus import CorpusFile
from recipe.data import eval_windows, random_windows, token_stream
from recipe.objectives import distill_loss
from recipe.train import TrainConfig, TrainResult, train

logger = logging.getLogger("recipe")


@dataclass(frozen=True)
class DraftShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int

    @classmethod
    def for_target(cls, target: PretrainedConfig) -> DraftShape:
        # A quarter of the width and an eighth of the depth is ~10-30x fewer non-embedding parameters.
        text = target.get_text_config()
        hidden = max(64, text.hidden_size // 4 // 32 * 32)
        return cls(hidden, max(1, text.num_hidden_layers // 8), max(1, hidden // 32), hidden * 3)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def draft_config(target: PretrainedConfig, shape: DraftShape, max_positions: int) -> LlamaConfig:
    text = target.get_text_config()
    return LlamaConfig(
        vocab_size=text.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=getattr(text, "bos_token_id", None),
        eos_token_id=getattr(text, "eos_token_id", None),
        pad_token_id=getattr(text, "pad_token_id", None),
    )


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def distill(
    target_path: str,
    out: Path,
    corpus: list[CorpusFile],
    shape: DraftShape | None,
    cfg: TrainConfig,
    seq_len: int = 512,
    batch_size: int = 8,
    seed: int = 0,
    device: str = "auto",
    held_out: list[CorpusFile] | None = None,
    trust_remote_code: bool = False,
) -> TrainResult:
    dev = pick_device(device)
    # Teacher in bf16 on CUDA (tensor cores); fp32 on CPU, where bf16 matmuls without AMX/AVX512-BF16 are
    # ~3x slower than fp32 (measured on the project's 2-core machines).
    teacher_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(target_path, trust_remote_code=trust_remote_code)
    teacher = AutoModelForCausalLM.from_pretrained(
        target_path, dtype=teacher_dtype, trust_remote_code=trust_remote_code
    ).to(dev)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    shape = shape or DraftShape.for_target(teacher.config)
    max_pos = getattr(teacher.config.get_text_config(), "max_position_embeddings", seq_len)
    seq_len = min(seq_len, max_pos)
    torch.manual_seed(seed)
    student = LlamaForCausalLM(draft_config(teacher.config, shape, max_pos)).to(dev)
    logger.info(
        "distill: target %s (%.1fM params) -> draft %s (%.2fM params) on %s",
        target_path, param_count(teacher) / 1e6, shape, param_count(student) / 1e6, dev,
    )
    t0 = time.perf_counter()
    stream = token_stream(corpus, tokenizer)
    logger.info("distill: %d corpus files, %d tokens (tokenized in %.1fs)", len(corpus), stream.numel(),
                time.perf_counter() - t0)
    batches = (b.to(dev) for b in random_windows(stream, batch_size, seq_len, seed))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        with autocast:
            return distill_loss(teacher, model, batch)

    evaluate = None
    if held_out:
        windows = eval_windows(token_stream(held_out, tokenizer), seq_len, max_windows=32).to(dev)

        def evaluate() -> float:
            return greedy_agreement(teacher, student, windows)

    result = train(student, batches, loss_fn, cfg, evaluate=evaluate, what="distill")
    save_draft(student, tokenizer, target_path, out, {
        "target": str(target_path), "shape": asdict(shape), "train": asdict(cfg), "seq_len": seq_len,
        "batch_size": batch_size, "seed": seed, "device": str(dev), "params": param_count(student),
        "tokens": result.tokens, "seconds": round(result.seconds, 1), "final_kl": result.final_loss,
        "held_out_greedy_agreement": result.evals,
    })
    return result


@torch.no_grad()
def greedy_agreement(teacher: torch.nn.Module, student: torch.nn.Module, windows: torch.Tensor) -> float:
    """Share of positions where the draft's argmax is the target's: the per-token greedy acceptance."""
    agree, total = 0, 0
    for i in range(0, windows.shape[0], 8):
        inputs = windows[i : i + 8, :-1]
        p = teacher(input_ids=inputs).logits
        q = student(input_ids=inputs).logits
        v = min(p.shape[-1], q.shape[-1])
        agree += int((p[..., :v].argmax(-1) == q[..., :v].argmax(-1)).sum())
        total += inputs.numel()
    return agree / total


def save_draft(student: torch.nn.Module, tokenizer: object, target_path: str, out: Path, record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    student.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    gen_cfg = Path(target_path) / "generation_config.json"
    if gen_cfg.exists():
        shutil.copy(gen_cfg, out / "generation_config.json")
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    logger.info("distill: saved draft to %s", out)

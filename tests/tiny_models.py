"""Tiny random models and a tiny tokenizer, built in the tests themselves (no hub, no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 320  # the tokenizer has fewer entries: the rest are padding rows, as in real checkpoints
EOS = 0
CORPUS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nprint(os.path.join('a', 'b'))\n# héllo wörld ünïcode ✓\n",
]


def tiny_config(arch: str, seed_layers: int = 2, hidden: int = 64) -> PretrainedConfig:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=seed_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=EOS,
        bos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=24)  # shorter than the tests' contexts
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=16)
    if arch == "gemma":
        return GemmaConfig(**common, head_dim=16)
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB, n_embd=hidden, n_layer=seed_layers, n_head=4, n_positions=512,
            eos_token_id=EOS, bos_token_id=1,
        )
    raise ValueError(arch)


ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma")


def build_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|bos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|bos|>", pad_token="<|pad|>"
    )
    fast.save_pretrained(out)
    return fast


def save_model(config: PretrainedConfig, out: Path, seed: int, tokenizer_dir: Path | None = None,
               perturb_from: torch.nn.Module | None = None, noise: float = 0.0) -> torch.nn.Module:
    """A random model; with ``perturb_from``, a copy of that model plus Gaussian noise on every weight
    (a draft that agrees often but not always)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if perturb_from is not None:
        model.load_state_dict(perturb_from.state_dict())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise * p.std().clamp(min=1e-3))
    model.eval()
    model.save_pretrained(out)
    if tokenizer_dir is not None:
        PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(out)
    return model


def eagle_head_config(hidden: int = 64, draft_vocab: int | None = None) -> LlamaConfig:
    """An EAGLE-3 head's config for the tiny targets (of any architecture: the head is Llama-style)."""
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        draft_vocab_size=draft_vocab or VOCAB, eos_token_id=EOS, tie_word_embeddings=False,
    )


def save_eagle_head(out: Path, seed: int, hidden: int = 64, draft_vocab: int | None = None,
                    own_embeddings: bool = False) -> torch.nn.Module:
    """A random EAGLE-3 head in the published layout; with ``draft_vocab``, a reduced vocabulary of the even
    token ids 0, 2, 4, ..., then odd ones (so that d2t is not all zeros)."""
    from engine.models.eagle_head import Eagle3Head, save_head

    torch.manual_seed(seed)
    head = Eagle3Head(eagle_head_config(hidden, draft_vocab), hidden, own_embeddings=own_embeddings)
    if draft_vocab:
        head.set_draft_vocab(torch.cat([torch.arange(0, VOCAB, 2), torch.arange(1, VOCAB, 2)])[:draft_vocab])
    save_head(head.eval(), out)
    return head


def save_with_exit_head(target: Path, out: Path, seed: int, layers: int = 1, draft_vocab: int = VOCAB - 20,
                        noise: float = 0.5) -> Path:
    """``target``'s files copied to ``out`` with an exit head in ``out/exit_head``: the target's own LM head rows
    for a reduced vocabulary (even ids, then odd ones) plus noise, so its drafts are often, not always, the
    early exit's through the full head."""
    import shutil

    from engine.models import exit_head

    out.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    weight = model.get_output_embeddings().weight
    torch.manual_seed(seed)
    head = exit_head.ExitHead(weight.shape[1], weight.shape[0], draft_vocab, layers)
    head.set_draft_vocab(torch.cat([torch.arange(0, VOCAB, 2), torch.arange(1, VOCAB, 2)])[:draft_vocab])
    with torch.no_grad():
        rows = weight[head.draft_ids()]
        head.lm_head.weight.copy_(rows + noise * rows.std() * torch.randn_like(rows))
    exit_head.save(head, out / exit_head.DIR_NAME)
    return out

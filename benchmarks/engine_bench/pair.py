"""The models and prompts: a random target with a truncated-copy draft, a useless draft, prompts."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

log = logging.getLogger(__name__)

SNIPPETS = [  # tests/tiny_models.CORPUS plus more of the same kind
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nprint(os.path.join('a', 'b'))\n# héllo wörld ünïcode ✓\n",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "x = [i * i for i in range(20) if i % 2]\nprint(sum(x))\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n",
    "with open('data.txt') as f:\n    for line in f:\n        print(line.strip())\n",
]


def build_pair(workdir: Path, quick: bool, draft_layers: int, embed_std: float, seed: int) -> tuple[Path, Path]:
    """A random Llama target and a draft that is its own first ``draft_layers`` layers."""
    from tests.tiny_models import VOCAB, build_tokenizer

    tok_dir = workdir / "tokenizer"
    build_tokenizer(tok_dir)
    hidden, layers, heads, inter = (64, 4, 4, 128) if quick else (512, 8, 8, 1376)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=1024,
        eos_token_id=0,
        bos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(cfg).eval()
    if embed_std > 0:
        with torch.no_grad():
            emb = target.get_input_embeddings().weight
            emb.mul_(embed_std / emb.std())
    target_dir, draft_dir = workdir / "target", workdir / "draft"
    target.save_pretrained(target_dir)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(target_dir)

    draft_layers = min(draft_layers, layers - 1)
    draft_cfg = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": draft_layers})
    draft = AutoModelForCausalLM.from_config(draft_cfg).eval()
    keep = {
        name: tensor
        for name, tensor in target.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < draft_layers
    }
    draft.load_state_dict(keep, strict=True)  # every draft weight is the target's own
    draft.save_pretrained(draft_dir)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(draft_dir)
    log.info(
        "built target (hidden %d, %d layers, vocab %d, embed std %s) and a %d-layer truncated draft in %s",
        hidden, layers, VOCAB, embed_std or "HF init", draft_layers, workdir,
    )
    return target_dir, draft_dir


def describe_pair(quick: bool, draft_layers: int, embed_std: float, seed: int) -> str:
    """The report's line on the pair build_pair makes."""
    size = "quick: hidden 64, 4 layers" if quick else "hidden 512, 8 layers, 8 heads"
    return (
        f"target: random Llama built here ({size}, vocab 320, embedding std {embed_std or 'HF init'}, "
        f"seed {seed}); draft: its first {draft_layers} layer(s) + embeddings, final norm, lm_head"
    )


def build_useless_draft(draft_dir: Path, out: Path, seed: int) -> Path:
    """The draft's architecture with fresh random weights (another seed): unrelated to the target."""
    cfg = AutoConfig.from_pretrained(draft_dir)
    torch.manual_seed(seed + 7919)
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(out)
    try:
        AutoTokenizer.from_pretrained(draft_dir).save_pretrained(out)
    except (OSError, ValueError, TypeError):
        pass  # no tokenizer: the engine then skips the vocabulary check, prompts are token ids anyway
    return out


def make_prompts(target_dir: Path, n: int, vocab: int, max_len: int) -> list[list[int]]:
    """``n`` token-id prompts: the snippets tokenized, or random ids where there is no tokenizer."""
    try:
        tok = AutoTokenizer.from_pretrained(target_dir)
    except (OSError, ValueError, TypeError):
        tok = None
    prompts = []
    gen = torch.Generator().manual_seed(1234)
    for i in range(n):
        ids = tok.encode(SNIPPETS[i % len(SNIPPETS)]) if tok is not None else []
        if not ids:
            ids = torch.randint(3, vocab, (24 + 3 * i,), generator=gen).tolist()
        prompts.append([t for t in ids if t < vocab][:max_len] or [1])
    return prompts

"""An EAGLE-3 draft head: one decoder layer reading the target's own hidden states.

The layout is the one published EAGLE-3 heads use with vLLM and SGLang (yuhuili/EAGLE3-*, SpecForge's
output): a Llama-style ``config.json`` with ``draft_vocab_size`` (and optionally ``target_hidden_size``,
``norm_before_residual``, ``eagle_config.eagle_aux_hidden_state_layer_ids``), and weights named

    fc.weight                       [H, 3 * H_target]   fuses the target's low, middle and high hidden states
    midlayer.input_layernorm.weight, midlayer.hidden_norm.weight, midlayer.post_attention_layernorm.weight
    midlayer.self_attn.{q,k,v}_proj.weight  [*, 2 * H]  attention over [embedding ; hidden] concatenated
    midlayer.self_attn.o_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight, lm_head.weight     [V_draft, H]
    d2t                             [V_draft] int64: draft id i is target id i + d2t[i]
    t2d                             [V] bool: which target ids the draft vocabulary holds (unused here)
    embed_tokens.weight             optional; without it the target's embedding is used
    lm_head.weight                  optional over the full vocabulary: without it the target's LM head is used

At position t the head reads the embedding of token t + 1 and a hidden vector for position t: the fused
target hidden states where the target has computed t, else its own previous output (chain drafting).
Its output at t predicts token t + 2, and its pre-norm output is the hidden vector of the next chain step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

ARCHITECTURE = "LlamaForCausalLMEagle3"


class EagleHeadError(ValueError):
    """The directory is not an EAGLE-3 head specd can load, or it does not fit the target."""


def local_dir(path: str) -> Path:
    """``path`` itself when it is a directory, else the local snapshot of the hub repository it names."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.bin"]))


def is_eagle_head(path: str) -> bool:
    """Whether ``path`` (a directory or a hub id) holds an EAGLE-3 head, told apart from a draft LM by its config."""
    if not path:
        return False
    try:
        config = Path(path) / "config.json" if Path(path).is_dir() else Path(
            __import__("huggingface_hub").hf_hub_download(path, "config.json"))
    except Exception:  # noqa: BLE001  # offline, unknown repository: not something we can tell is a head
        return False
    if not config.is_file():
        return False
    raw = json.loads(config.read_text())
    archs = raw.get("architectures") or []
    return any("eagle3" in a.lower() for a in archs) or raw.get("speculators_model_type") == "eagle3"


def aux_layer_ids(config: LlamaConfig, num_target_layers: int) -> tuple[int, ...]:
    """Which of the target's layers the head reads: the inputs of these decoder layers (index 0 is the
    embedding output), as vLLM counts them. The config's own list, else vLLM's default: low, middle, high."""
    eagle = getattr(config, "eagle_config", None) or {}
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None) or eagle.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        n = num_target_layers
        ids = [min(2, n - 1), n // 2, max(0, n - 3)]
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or not all(0 <= i < num_target_layers for i in ids):
        raise EagleHeadError(f"eagle_aux_hidden_state_layer_ids must be 3 layers in [0, {num_target_layers}), got "
                             f"{list(ids)}")
    return ids


class Eagle3Layer(nn.Module):
    """The head's one decoder layer: attention and MLP over [norm(embedding) ; norm(hidden)]."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx=0)
        attn = self.self_attn
        # The queries, keys and values read the concatenation, twice the width the Llama attention assumes.
        attn.q_proj = nn.Linear(2 * h, config.num_attention_heads * attn.head_dim, bias=config.attention_bias)
        attn.k_proj = nn.Linear(2 * h, config.num_key_value_heads * attn.head_dim, bias=config.attention_bias)
        attn.v_proj = nn.Linear(2 * h, config.num_key_value_heads * attn.head_dim, bias=config.attention_bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        """embeds, hidden [B, T, H] -> the layer's output [B, T, H], residual included (pre-norm)."""
        normed = self.hidden_norm(hidden)
        # Which of the two the residual stream starts from differs between published heads (a config flag).
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [1, T, 2H]
        x, _ = self.self_attn(x, position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs)
        x = residual + x
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    """Parameter and buffer names are the published checkpoints' (see the module docstring)."""

    def __init__(self, config: LlamaConfig, target_hidden_size: int | None = None,
                 own_embeddings: bool = False) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.draft_vocab_size: int = getattr(config, "draft_vocab_size", None) or config.vocab_size
        target_h = target_hidden_size or getattr(config, "target_hidden_size", None) or h
        self.fc = nn.Linear(3 * target_h, h, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(self.vocab_size, dtype=torch.bool))
        self.embed_tokens: nn.Embedding | None = nn.Embedding(self.vocab_size, h) if own_embeddings else None
        self._target_embed: nn.Embedding | None = None  # set by share_embeddings, not a submodule (not saved)

    def share_embeddings(self, embedding: nn.Module) -> None:
        """Use the target's input embedding (published heads without ``embed_tokens.weight``)."""
        object.__setattr__(self, "_target_embed", embedding)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedding = self.embed_tokens if self.embed_tokens is not None else self._target_embed
        if embedding is None:
            raise EagleHeadError("the head has no embed_tokens and no target embedding was shared")
        return embedding(input_ids)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                **kwargs: Any) -> torch.Tensor:
        """input_ids [B, T], hidden [B, T, H] (fused or the head's own), position_ids [B, T] -> the pre-norm
        output [B, T, H]. ``kwargs`` reach the attention function (specd's paged metadata, or a mask)."""
        embeds = self.embed(input_ids).to(hidden.dtype)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        return self.midlayer(embeds, hidden, position_embeddings, **kwargs)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's three hidden states, concatenated [..., 3 * H_target] -> the head's input [..., H]."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[R, H] -> float32 logits over the target's vocabulary [R, V]: -inf outside the draft vocabulary."""
        draft = self.lm_head(self.norm(prenorm)).float()  # [R, V_draft]
        if self.draft_vocab_size == self.vocab_size and not bool(self.d2t.any()):
            return draft
        full = draft.new_full((draft.shape[0], self.vocab_size), float("-inf"))
        ids = torch.arange(self.draft_vocab_size, device=draft.device) + self.d2t  # [V_draft] target ids
        return full.index_copy(1, ids, draft)

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary as the (sorted) target ids it holds, written as d2t and t2d."""
        ids = target_ids.sort().values.to(self.d2t.device)
        if ids.numel() != self.draft_vocab_size:
            raise EagleHeadError(f"{ids.numel()} ids for a draft vocabulary of {self.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True


def head_config(path: str) -> LlamaConfig:
    raw = json.loads((local_dir(path) / "config.json").read_text())
    if raw.get("speculators_model_type") == "eagle3":
        raise EagleHeadError(f"{path} is in the 'speculators' layout (speculators_model_type eagle3); specd reads "
                             "the EAGLE-3 layout with config.json of model_type llama and midlayer.* weights")
    raw.pop("architectures", None)
    config = LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    if config.num_hidden_layers != 1:
        raise EagleHeadError(f"{path}: EAGLE-3 heads have one decoder layer, config says {config.num_hidden_layers}")
    return config


def _state_dict(path: str) -> dict[str, torch.Tensor]:
    root = local_dir(path)
    files = sorted(root.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    bins = sorted(root.glob("*.bin"))
    if not bins:
        raise EagleHeadError(f"{path} holds no *.safetensors or *.bin weights")
    state = {}
    for f in bins:
        state.update(torch.load(f, map_location="cpu", weights_only=True))
    return state


def load_head(path: str, target_hidden_size: int, target_vocab: int,
              target_lm_head: nn.Module | None = None) -> Eagle3Head:
    """The head at ``path`` for a target of this width and vocabulary, on the CPU in float32. A head without
    ``lm_head.weight`` (and a full draft vocabulary) uses ``target_lm_head``, the target's own module."""
    config = head_config(path)
    if config.vocab_size != target_vocab:
        raise EagleHeadError(f"{path} is a head for a vocabulary of {config.vocab_size} tokens, the target has "
                             f"{target_vocab}")
    state = _state_dict(path)
    # Some exports prefix the layer as layers.0 (vLLM's internal name); the published one is midlayer.
    state = {k.replace("layers.0.", "midlayer.").removeprefix("model."): v for k, v in state.items()}
    fc = state.get("fc.weight")
    if fc is None or fc.shape[1] != 3 * target_hidden_size:
        got = None if fc is None else list(fc.shape)
        raise EagleHeadError(f"{path}: fc.weight must be [{config.hidden_size}, {3 * target_hidden_size}] to fuse "
                             f"three hidden states of this target (width {target_hidden_size}), got {got}")
    head = Eagle3Head(config, target_hidden_size, own_embeddings="embed_tokens.weight" in state)
    if "d2t" not in state:
        state["d2t"] = head.d2t.clone()
    if "t2d" not in state:
        state["t2d"] = head.t2d.clone()
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("rotary_emb.")]
    if "lm_head.weight" in missing and target_lm_head is not None and head.draft_vocab_size == target_vocab:
        head.lm_head = target_lm_head  # shared, not copied: the target's rows, as in EAGLE-1 style heads
        missing.remove("lm_head.weight")
    if missing or unexpected:
        raise EagleHeadError(f"{path}: weights do not match the EAGLE-3 layout (missing {missing}, unexpected "
                             f"{unexpected})")
    return head.eval()


def save_head(head: Eagle3Head, path: str | Path, extra: dict[str, Any] | None = None) -> None:
    """Writes ``config.json`` and ``model.safetensors`` in the published layout (loadable by load_head)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = head.config.to_dict()
    config.update(architectures=[ARCHITECTURE], draft_vocab_size=head.draft_vocab_size,
                  target_hidden_size=head.fc.in_features // 3, **(extra or {}))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items() if not k.startswith("rotary_emb.")}
    save_file(state, str(out / "model.safetensors"))

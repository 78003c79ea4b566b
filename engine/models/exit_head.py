"""A trained exit head for self-speculation: the LM head the target's first L layers draft through.

Read through the target's own final norm and LM head, early layers agree with the full model rarely (the
embedded target's layer 1: 6% of greedy tokens). ``specd distill --method self`` trains a replacement LM head
for one depth L over a reduced draft vocabulary (the most frequent tokens, as EAGLE-3 heads do): fitted to the
full model's distribution at that depth, and a fraction of the full head's rows, which is most of what an
early exit costs when the vocabulary is large beside the width.

It ships inside the target's checkpoint, ``<target>/exit_head/``:

    config.json        {"architectures": ["SpecdExitHead"], "exit_layers": L, "hidden_size": H,
                        "vocab_size": V, "draft_vocab_size": N}
    model.safetensors  lm_head.weight [N, H], d2t [N] int64 (draft id i is target id i + d2t[i], EAGLE-3's map)

The engine uses it when self-speculation runs at that depth (engine.core.loader); at another depth the early
exit reads through the target's own head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

ARCHITECTURE = "SpecdExitHead"
DIR_NAME = "exit_head"
# Outside the draft vocabulary: finite, like the EAGLE head's, so a grammar allowing none of the draft
# vocabulary leaves a distribution (uniform over what it allows) rather than NaN.
OUTSIDE = -1e9


class ExitHeadError(ValueError):
    """The exit head cannot be read, or does not fit the target."""


class ExitHead(nn.Module):
    """Linear [H -> N] over the draft vocabulary, written into the target's vocabulary [V] (OUTSIDE elsewhere).

    It takes the place of the LM head in the early exit's forward, so it reads the target's final norm output."""

    def __init__(self, hidden_size: int, vocab_size: int, draft_vocab_size: int, exit_layers: int) -> None:
        super().__init__()
        if not 1 <= draft_vocab_size <= vocab_size:
            raise ExitHeadError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
        self.hidden_size, self.vocab_size, self.exit_layers = hidden_size, vocab_size, exit_layers
        self.draft_vocab_size = draft_vocab_size
        self.lm_head = nn.Linear(hidden_size, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))

    def draft_ids(self) -> torch.Tensor:
        """[N] sorted target ids of the draft vocabulary."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        ids = target_ids.sort().values.to(self.d2t.device)
        if ids.numel() != self.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ExitHeadError(f"{ids.numel()} ids (distinct: {ids.unique().numel()}) for a draft vocabulary of "
                                f"{self.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] (the final norm's output) -> [..., N] over the draft vocabulary."""
        return self.lm_head(hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V]: the draft logits at their target ids, OUTSIDE elsewhere."""
        draft = self.draft_logits(hidden)  # [..., N]
        full = draft.new_full((*draft.shape[:-1], self.vocab_size), OUTSIDE)
        return full.index_copy(-1, self.draft_ids(), draft)


def find(target_path: str) -> Path | None:
    """``<target>/exit_head`` when the target is a local directory holding one."""
    path = Path(target_path) / DIR_NAME
    return path if (path / "config.json").is_file() else None


def exit_layers(path: str | Path) -> int:
    """The depth the head at ``path`` was trained for."""
    try:
        return int(json.loads((Path(path) / "config.json").read_text())["exit_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ExitHeadError(f"{path}/config.json: no readable exit_layers ({exc})") from exc


def load(path: str | Path, hidden_size: int, vocab_size: int) -> ExitHead:
    """The exit head at ``path`` for a target of this width and vocabulary, on the CPU in float32."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
        state = load_file(str(path / "model.safetensors"))
    except (OSError, ValueError) as exc:
        raise ExitHeadError(f"cannot read the exit head at {path}: {exc}") from exc
    if ARCHITECTURE not in (raw.get("architectures") or []):
        raise ExitHeadError(f"{path}/config.json: architectures must contain {ARCHITECTURE!r}")
    for field, want in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if raw.get(field) != want:
            raise ExitHeadError(f"{path}/config.json: {field} is {raw.get(field)}, the target has {want}")
    try:
        head = ExitHead(hidden_size, vocab_size, int(raw["draft_vocab_size"]), int(raw["exit_layers"]))
    except KeyError as exc:
        raise ExitHeadError(f"{path}/config.json: missing {exc.args[0]}") from exc
    try:
        head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    except RuntimeError as exc:
        raise ExitHeadError(f"{path}/model.safetensors does not fit the config: {exc}") from exc
    ids = head.draft_ids()
    if ids.min() < 0 or ids.max() >= vocab_size or not bool((ids[1:] > ids[:-1]).all()):
        raise ExitHeadError(f"{path}: d2t must map the draft vocabulary to increasing target ids below {vocab_size}")
    return head.eval()


def save(head: ExitHead, path: str | Path, dtype: torch.dtype = torch.float32) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [ARCHITECTURE], "exit_layers": head.exit_layers, "hidden_size": head.hidden_size,
              "vocab_size": head.vocab_size, "draft_vocab_size": head.draft_vocab_size,
              "dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {"lm_head.weight": head.lm_head.weight.detach().to(dtype).contiguous().cpu(),
             "d2t": head.d2t.detach().contiguous().cpu()}
    save_file(state, str(path / "model.safetensors"))

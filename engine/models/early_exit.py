"""The target's first L layers as a model of their own, for self-speculative drafting.

No weight is copied: the shallow model holds the very modules of the target (embeddings, the first L
decoder layers, the final norm, the LM head), so its layer i is the target's layer i, with the same
``layer_idx``, and writes the same KV cache layer. What differs is only which layers the forward runs.
"""

from __future__ import annotations

import copy

import torch


class EarlyExitError(ValueError):
    """The model's decoder layers could not be found, or L is out of range."""


def _layer_list(decoder: torch.nn.Module, num_layers: int) -> str:
    """The attribute of ``decoder`` holding its decoder layers: the ModuleList as long as the model is deep
    (``layers`` for Llama-style models, ``h`` for GPT-2)."""
    found = [name for name, child in decoder.named_children()
             if isinstance(child, torch.nn.ModuleList) and len(child) == num_layers]
    if len(found) != 1:
        raise EarlyExitError(f"cannot tell which of {type(decoder).__name__}'s module lists holds its "
                             f"{num_layers} decoder layers (found {found or 'none'})")
    return found[0]


def decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    """The ModuleList of a causal LM's ``num_layers`` decoder layers."""
    decoder = _decoder(model)
    return getattr(decoder, _layer_list(decoder, num_layers))


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    prefix = getattr(model, "base_model_prefix", "")
    decoder = getattr(model, prefix, None) if prefix else None
    if not isinstance(decoder, torch.nn.Module):
        raise EarlyExitError(f"{type(model).__name__} has no decoder under base_model_prefix {prefix!r}")
    return decoder


def truncate(model: torch.nn.Module, num_layers: int, keep: int) -> torch.nn.Module:
    """``model`` (a causal LM with ``num_layers`` decoder layers) running only its first ``keep`` layers,
    then its own final norm and LM head. Shares every parameter with ``model``."""
    if not 1 <= keep < num_layers:
        raise EarlyExitError(f"draft_layers must be in [1, {num_layers - 1}] for a target of {num_layers} layers, "
                             f"got {keep}")
    prefix = model.base_model_prefix
    decoder = _decoder(model)
    name = _layer_list(decoder, num_layers)
    config = copy.deepcopy(decoder.config)
    # Llama-style forwards loop over layers[: config.num_hidden_layers]; GPT-2's aliases it as n_layer.
    config.num_hidden_layers = keep
    # copy.copy of a Module shares its child and parameter dicts: give each copy its own child dict, so
    # that swapping a child here leaves the target untouched.
    short_decoder = copy.copy(decoder)
    short_decoder._modules = dict(decoder._modules)
    short_decoder._modules[name] = torch.nn.ModuleList(list(getattr(decoder, name))[:keep])
    short_decoder.config = config
    short = copy.copy(model)
    short._modules = dict(model._modules)
    short._modules[prefix] = short_decoder
    short.config = config
    return short

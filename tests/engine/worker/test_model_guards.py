"""Which of a precompiled graph's guards are the model's, checked once at load (engine.worker.model_guards): the
compiled entry's module tree, and nothing a forward's inputs or a hook's bound object (the runner) reach."""

from __future__ import annotations

import pytest

from engine.worker.model_guards import on_the_model

LAYER = "L['self']._modules['model']._modules['model']._modules['layers']._modules['0']"


@pytest.mark.parametrize(("name", "once"), [
    (f"{LAYER}._modules['mlp']._modules['up_proj']._parameters['weight']", True),
    (f"{LAYER}._forward_pre_hooks", True),
    ("L['self']._modules['model'].config._attn_implementation_internal", True),
    ("dict(type(L['self']._modules['model']).__dict__)['forward'].__closure__[0].cell_contents.__defaults__", True),
    ("L['self']._modules['model']._modules['lm_head']._forward_pre_hooks[0].__self__._rows.keep", False),
    ("L['inputs']['input_ids']", False),
    ("L['inputs']['specd_attn'].cache.k[0]", False),
    ("G['__import_engine_dot_layers_dot_tracing'].state", False),
    ("", False),
])
def test_only_guards_on_the_models_own_tree_are_checked_once(name: str, once: bool) -> None:
    assert on_the_model(name) is once

"""Session-wide tiny models: built once from configs, saved to a temp dir, never downloaded."""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.tiny_models import (
    ARCHS,
    VOCAB,
    build_tokenizer,
    save_eagle_head,
    save_model,
    save_with_exit_head,
    tiny_config,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # lm-evaluation-harness reads its local task files through datasets
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM would fetch its price list
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# Servers the tests start from flags or the environment run eagerly unless a test asks otherwise: the default
# (compile auto: a background compile on CPU) would have each of them compiling beside the suite's other work.
os.environ.setdefault("SPECD_COMPILE", "off")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # The tiny models' forwards are Python-bound and run on one core; with several workers each keeps its
    # share of the cores, since OpenMP threads of two workers spinning on the same cores slow both.
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

# Modules whose work is mostly a child process's at the lowest CPU priority: first, so that it takes what the
# other tests leave all through the run (test_compile's cold compile of a pair: ~850 s of one core on a 2-core
# AVX2 host). `make test` keeps this order (--no-loadscope-reorder).
FIRST = ("tests/engine/worker/test_compile.py",)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """FIRST, then the modules with the most tests (xdist's own order: big work units first)."""
    counts = collections.Counter(map(_module, items))
    items.sort(key=lambda item: (_module(item) not in FIRST, -counts[_module(item)]))  # stable: order kept within


@dataclass(frozen=True)
class ModelSet:
    arch: str
    target: Path
    draft: Path  # the target plus noise: agrees often, not always
    unrelated: Path  # an independent random model of the same shape


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def model_sets(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, ModelSet]:
    root = tmp_path_factory.mktemp("models")
    sets = {}
    for i, arch in enumerate(ARCHS):
        cfg = tiny_config(arch)
        target = save_model(cfg, root / f"{arch}-target", seed=100 + i, tokenizer_dir=tokenizer_dir)
        save_model(
            cfg, root / f"{arch}-draft", seed=200 + i, tokenizer_dir=tokenizer_dir, perturb_from=target, noise=0.15
        )
        save_model(cfg, root / f"{arch}-unrelated", seed=300 + i, tokenizer_dir=tokenizer_dir)
        sets[arch] = ModelSet(arch, root / f"{arch}-target", root / f"{arch}-draft", root / f"{arch}-unrelated")
    return sets


@pytest.fixture(scope="session")
def eagle_heads(tmp_path_factory: pytest.TempPathFactory, model_sets: dict[str, ModelSet]) -> dict[str, Path]:
    """Per architecture, an EAGLE-3 head for the tiny target (a reduced draft vocabulary, so d2t maps)."""
    root = tmp_path_factory.mktemp("eagle")
    heads = {}
    for i, arch in enumerate(ARCHS):
        heads[arch] = root / arch
        save_eagle_head(heads[arch], seed=400 + i, draft_vocab=VOCAB - 20)
    return heads


@pytest.fixture(scope="session")
def exit_targets(tmp_path_factory: pytest.TempPathFactory, model_sets: dict[str, ModelSet]) -> dict[str, Path]:
    """Per architecture, the tiny target with an exit head for its first layer (a reduced draft vocabulary)."""
    root = tmp_path_factory.mktemp("exit")
    return {arch: save_with_exit_head(model_sets[arch].target, root / arch, seed=500 + i)
            for i, arch in enumerate(ARCHS)}

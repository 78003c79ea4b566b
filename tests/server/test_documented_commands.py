"""Every documented serve command plans and would start on an 80 GiB and a 24 GiB GPU (`--dry-run`).

The commands come from the README, docs/, the Dockerfile's comments, configs/*.yaml and the Kubernetes ConfigMap.
The models they name are local directories holding the real models' config.json files (typed below; no weights)
and the embedded tokenizer as a stand-in. Only the model paths change, and `--device cuda --dry-run
--device-memory SIZE` is appended.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from server.cli import main

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "models" / "default" / "target"

_LLAMA3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", attention_bias=False,
               bos_token_id=128000, eos_token_id=128001, rms_norm_eps=1e-5, rope_theta=500000.0,
               max_position_embeddings=131072, vocab_size=128256, num_key_value_heads=8, torch_dtype="bfloat16")
_ROPE = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192, rope_type="llama3")
_QWEN = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6,
             rope_theta=1000000.0, max_position_embeddings=32768, use_sliding_window=False, sliding_window=32768,
             bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")
CONFIGS = {  # the published config.json files' shapes
    "Llama-3.1-8B-Instruct": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                              "num_attention_heads": 32, "tie_word_embeddings": False,
                              "rope_scaling": {"factor": 8.0, **_ROPE}},
    "Llama-3.2-1B-Instruct": {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                              "num_attention_heads": 32, "head_dim": 64, "tie_word_embeddings": True,
                              "rope_scaling": {"factor": 32.0, **_ROPE}},
    "Llama-3.1-70B-Instruct": {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                               "num_attention_heads": 64, "tie_word_embeddings": False,
                               "rope_scaling": {"factor": 8.0, **_ROPE}},
    "Qwen2.5-7B-Instruct": {**_QWEN, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                            "num_attention_heads": 28, "num_key_value_heads": 4, "max_window_layers": 28,
                            "vocab_size": 152064, "tie_word_embeddings": False},
    "Qwen2.5-0.5B-Instruct": {**_QWEN, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                              "num_attention_heads": 14, "num_key_value_heads": 2, "max_window_layers": 21,
                              "vocab_size": 151936, "tie_word_embeddings": True},
}
# What the docs call a model, by its last path component -> the directory standing in for it.
STANDS_IN = {"Llama-3.1-8B-Instruct": "Llama-3.1-8B-Instruct", "Llama-3.2-1B-Instruct": "Llama-3.2-1B-Instruct",
             "Llama-3.1-70B-Instruct": "Llama-3.1-70B-Instruct", "target": "Llama-3.1-8B-Instruct",
             "draft": "Llama-3.2-1B-Instruct", "my-model": "Llama-3.1-8B-Instruct", "my-draft": "Llama-3.2-1B-Instruct"}
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.fixture(autouse=True)
def root_logging_restored():
    """main() configures the root logger as a real start would (basicConfig, force=True): put it back, or the
    rest of this worker's tests would run with INFO records flowing."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    root.setLevel(level)
    root.handlers[:] = handlers


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("configs")
    for name, config in CONFIGS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        for f in TOKENIZER.iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                shutil.copy(f, root / name)
    return root


def _blocks(text: str) -> list[str]:
    """Fenced blocks' shell lines, continuations joined, comments cut."""
    out = []
    for block in re.findall(r"```(?:bash|sh|shell)\b[^\n]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            out.append(line.split(" #")[0].strip())
    return out


def _serve_args(line: str) -> list[str] | None:
    """The specd serve arguments of a `specd serve ...` or `docker run ... specd ...` line, else None."""
    words = shlex.split(line)
    if "specd" in words and words[words.index("specd") + 1 : words.index("specd") + 2] == ["serve"]:
        return words[words.index("specd") + 2 :]
    if words[:2] != ["docker", "run"] or "--gpus" not in words:
        return None
    image = next(i for i, w in enumerate(words) if w == "specd" or w.startswith("specd:"))
    args = words[image + 1 :]
    for i, w in enumerate(words[:image]):  # the image reads SPECD_CONFIG like the server does
        if w == "-e" and words[i + 1].startswith("SPECD_CONFIG="):
            args = ["--config", words[i + 1].split("=", 1)[1].replace("/configs/", "configs/")] + args
    return args


def documented() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for line in _blocks(page.read_text()):
            args = _serve_args(line) if "specd serve" in line or line.startswith("docker run") else None
            if args is not None:
                found.append((f"{page.name}: {line[:60]}", args))
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("#") and "docker run --gpus" in line:
            found.append((f"Dockerfile: {line[:60]}", _serve_args(line.lstrip("# ").strip()) or []))
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        found.append((f"configs/{config.name}", ["--config", f"configs/{config.name}"]))
    configmap = yaml.safe_load((ROOT / "deploy/k8s/configmap.yaml").read_text())
    found.append(("deploy/k8s/configmap.yaml", ["--config", "k8s:specd.yaml", configmap["data"]["specd.yaml"]]))
    return found


def localise(args: list[str], models: Path, tmp: Path) -> list[str]:
    """The same command with the stand-in directories for the models it names."""
    out, it = [], iter(args)
    for word in it:
        if word == "--config":
            source = next(it)
            if source == "k8s:specd.yaml":
                config = yaml.safe_load(next(it))
            else:
                config = yaml.safe_load((ROOT / source).read_text()) or {}
            for key in ("model", "draft_model"):
                if key in config:
                    config[key] = str(models / STANDS_IN[Path(config[key]).name])
            path = tmp / f"config-{len(list(tmp.iterdir()))}.yaml"
            path.write_text(yaml.safe_dump(config))
            out += ["--config", str(path)]
        elif word in ("--model", "--draft-model"):
            out += [word, str(models / STANDS_IN[Path(next(it)).name])]
        else:
            out.append(word)
    return out


def plan(argv: list[str], memory: str, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = main(["serve", *argv, "--device", "cuda", "--dry-run", "--device-memory", memory])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


COMMANDS = documented()


def test_the_docs_hold_the_commands_this_test_runs():
    names = " ".join(name for name, _ in COMMANDS)
    assert {"README.md", "deployment.md", "quickstart.md", "Dockerfile", "configs/llama-3.1-8b-gpu.yaml",
            "deploy/k8s/configmap.yaml"} <= set(re.findall(r"[\w./-]+\.(?:md|yaml)|Dockerfile", names)), names


@pytest.mark.parametrize("memory", ["80GiB", "24GiB"])
@pytest.mark.parametrize(("where", "args"), COMMANDS, ids=[name for name, _ in COMMANDS])
def test_each_documented_command_plans_and_would_start(where, args, memory, models, tmp_path, capsys):
    code, out = plan(localise(args, models, tmp_path), memory, capsys)
    assert code == 0, f"{where} on {memory}: {out}"
    assert "memory plan" in out and "full-length sequences fit at once" in out, out


def test_the_readme_8b_command_gets_at_least_32k_of_context_on_80_gib(models, tmp_path, capsys):
    readme_8b = ["--model", "meta-llama/Llama-3.1-8B-Instruct"]
    [args] = [a for w, a in COMMANDS if w.startswith("README.md") and a[:2] == readme_8b and "--dry-run" not in a]
    code, out = plan(localise(args, models, tmp_path), "80GiB", capsys)
    context = int(re.search(r"context +(\d+) tokens", out).group(1))  # type: ignore[union-attr]
    assert code == 0 and context >= 32768, out
    assert "max_model_len capped" in out  # 131,072 tokens would not fit 4 sequences: said, not silent


def test_a_qwen_pair_whose_vocabularies_differ_by_padding_rows_plans_like_a_start(models, capsys):
    args = ["--model", str(models / "Qwen2.5-7B-Instruct"), "--draft-model", str(models / "Qwen2.5-0.5B-Instruct")]
    for memory in ("80GiB", "24GiB"):
        code, out = plan(args, memory, capsys)
        assert code == 0, out
        assert "context      32768 tokens" in out or "max_model_len capped" in out, out


def test_70b_in_bf16_on_one_80_gib_device_exits_2_naming_the_shortfall_and_the_way_out(models, capsys):
    code, out = plan(["--model", str(models / "Llama-3.1-70B-Instruct"), "--dtype", "bfloat16"], "80GiB", capsys)
    assert code == 2, out
    assert re.search(r"short by \d+\.\d GiB", out) and "--device-map" in out and "quantised" in out, out
    assert "--tensor-parallel-size 2" in out, out


def test_70b_in_bf16_sharded_over_two_80_gib_devices_plans_half_the_weights_per_rank(models, capsys):
    code, out = plan(["--model", str(models / "Llama-3.1-70B-Instruct"), "--dtype", "bfloat16",
                      "--tensor-parallel-size", "2", "--device", "cuda"], "80GiB", capsys)
    assert code == 0, out
    assert "per rank of 2" in out, out
    per_rank = float(re.search(r"weights +(\d+\.\d+) GiB", out).group(1))  # type: ignore[union-attr]
    assert 64 < per_rank < 67, out  # 70.6B parameters in bf16: 131.4 GiB, half of it on each rank


def test_a_tensor_parallel_size_that_does_not_divide_the_kv_heads_exits_2_naming_the_sizes_that_do(models, capsys):
    code, out = plan(["--model", str(models / "Llama-3.1-8B-Instruct"), "--tensor-parallel-size", "3",
                      "--device", "cuda"], "80GiB", capsys)
    assert code == 2, out
    assert "does not divide the target's 32 attention heads and 8 KV heads: use one of [2, 4, 8]" in out, out


def test_an_explicit_context_that_cannot_fit_names_the_largest_that_does(models, capsys):
    args = ["--model", str(models / "Llama-3.1-8B-Instruct"), "--max-model-len", "131072"]
    code, out = plan(args, "24GiB", capsys)
    largest = int(re.search(r"largest max_model_len that fits is (\d+)", out).group(1))  # type: ignore[union-attr]
    assert code == 2 and 1000 < largest < 131072, out
    code, out = plan([*args[:-1], str(largest)], "24GiB", capsys)
    assert code == 0, out  # and that value does start


def test_device_memory_without_dry_run_is_refused(models, capsys):
    code = main(["serve", "--model", str(models / "Llama-3.1-8B-Instruct"), "--device-memory", "80GiB"])
    assert code == 2 and "--dry-run" in capsys.readouterr().err

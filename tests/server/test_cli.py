"""The command line: YAML and flags, the missing default pair, and the process's exit codes on
SIGTERM and SIGINT (drain, exit 0), an engine crash and a failed load (exit non-zero, no zombie)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import server.config
from benchmarks.peer_bench.ports import free_port
from server.cli import build_parser, main, parse_config
from server.config import ConfigError

pytestmark = pytest.mark.timeout(300)  # a process imports torch: slow on a busy 2-core machine

ROOT = Path(__file__).resolve().parents[2]


def test_flags_win_over_yaml_keys_written_either_way(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: org/m\nmax-num-seqs: 8\nport: 9000\nnum_speculative_tokens: adaptive\nhost: 0.0.0.0\n")
    config = parse_config(["serve", "--config", str(path), "--port", "9001", "--draft-model", "org/d"])
    assert (config.model, config.max_num_seqs, config.port, config.host) == ("org/m", 8, 9001, "0.0.0.0")
    assert config.num_speculative_tokens is None and config.method == "hybrid"
    assert config.served_name == "m"
    engine_config = config.engine_config()
    assert engine_config.draft_model == "org/d" and engine_config.max_num_seqs == 8
    assert parse_config(["serve", "--model", "org/m", "--num-speculative-tokens", "3"]).num_speculative_tokens == 3
    assert parse_config(["serve", "--model", "org/m"]).host == "127.0.0.1"


def test_reliability_options_have_flags_variables_and_safe_defaults(monkeypatch, tmp_path):
    default = parse_config(["serve", "--model", "org/m"])
    assert (default.max_n, default.max_stop_sequences, default.max_body_bytes) == (128, 4, 8 * 2**20)
    assert (default.request_timeout, default.cors_allow_origins, default.trust_remote_code) == (None, None, False)
    config = parse_config(["serve", "--model", "org/m", "--max-n", "8", "--max-stop-sequences", "2",
                           "--max-body-bytes", "65536", "--request-timeout", "30", "--cors-allow-origins", "https://a.example"])
    assert (config.max_n, config.max_stop_sequences, config.max_body_bytes) == (8, 2, 65536)
    assert config.request_timeout == 30.0 and config.cors_origins == ["https://a.example"]
    monkeypatch.setenv("SPECD_REQUEST_TIMEOUT", "2.5")
    monkeypatch.setenv("SPECD_CORS_ALLOW_ORIGINS", "https://a.example, https://b.example")
    config = parse_config(["serve", "--model", "org/m"])
    assert config.request_timeout == 2.5 and config.cors_origins == ["https://a.example", "https://b.example"]
    path = tmp_path / "c.yaml"
    path.write_text("model: org/m\ncors-allow-origins: [https://a.example, https://b.example]\n")
    assert parse_config(["serve", "--config", str(path)]).cors_origins == ["https://a.example", "https://b.example"]
    for bad in (["--max-n", "0"], ["--request-timeout", "0"], ["--max-body-bytes", "-1"]):
        with pytest.raises(ConfigError):
            parse_config(["serve", "--model", "org/m", *bad])


def test_prefix_caching_is_on_unless_a_flag_a_variable_or_the_yaml_turns_it_off(monkeypatch, tmp_path):
    assert parse_config(["serve", "--model", "org/m"]).engine_config().prefix_caching is True
    assert parse_config(["serve", "--model", "org/m", "--no-prefix-caching"]).engine_config().prefix_caching is False
    path = tmp_path / "c.yaml"
    path.write_text("model: org/m\nprefix-caching: false\n")
    assert parse_config(["serve", "--config", str(path)]).prefix_caching is False
    monkeypatch.setenv("SPECD_PREFIX_CACHING", "false")
    assert parse_config(["serve", "--model", "org/m"]).prefix_caching is False


def test_cuda_graphs_follow_the_device_unless_a_flag_a_variable_or_the_yaml_decides(monkeypatch, tmp_path):
    assert parse_config(["serve", "--model", "org/m"]).engine_config().cuda_graphs is None  # the loader decides
    assert parse_config(["serve", "--model", "org/m", "--cuda-graphs"]).engine_config().cuda_graphs is True
    assert parse_config(["serve", "--model", "org/m", "--no-cuda-graphs"]).engine_config().cuda_graphs is False
    path = tmp_path / "c.yaml"
    path.write_text("model: org/m\ncuda-graphs: false\n")
    assert parse_config(["serve", "--config", str(path)]).cuda_graphs is False
    monkeypatch.setenv("SPECD_CUDA_GRAPHS", "true")
    assert parse_config(["serve", "--model", "org/m"]).cuda_graphs is True


def test_compile_is_auto_unless_a_flag_a_variable_or_the_yaml_decides(monkeypatch, tmp_path):
    from engine import CompileMode

    monkeypatch.delenv("SPECD_COMPILE")  # the suite's servers run eagerly (tests/conftest.py)
    assert parse_config(["serve", "--model", "org/m"]).engine_config().compile is CompileMode.AUTO
    assert parse_config(["serve", "--model", "org/m", "--compile"]).engine_config().compile is CompileMode.START
    for mode in CompileMode:
        assert parse_config(["serve", "--model", "org/m", "--compile", mode.value]).engine_config().compile is mode
    path = tmp_path / "c.yaml"
    for written, mode in (("off", "off"), ("false", "off"), ("true", "start"), ("background", "background")):
        path.write_text(f"model: org/m\ncompile: {written}\n")  # YAML reads off, false and true as booleans
        assert parse_config(["serve", "--config", str(path)]).compile == mode
    monkeypatch.setenv("SPECD_COMPILE", "background")
    assert parse_config(["serve", "--model", "org/m"]).compile == "background"
    monkeypatch.setenv("SPECD_COMPILE", "sometimes")
    with pytest.raises(ConfigError, match="compile must be one of auto, off, start, background, got 'sometimes'"):
        parse_config(["serve", "--model", "org/m"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--compile", "sometimes"])


def test_paged_attention_is_auto_unless_a_flag_a_variable_or_the_yaml_decides(monkeypatch, tmp_path):
    assert parse_config(["serve", "--model", "org/m"]).engine_config().paged_attention == "auto"
    assert parse_config(["serve", "--model", "org/m", "--paged-attention", "gather"]).engine_config().paged_attention \
        == "gather"
    path = tmp_path / "c.yaml"
    path.write_text("model: org/m\npaged-attention: flex\n")
    assert parse_config(["serve", "--config", str(path)]).paged_attention == "flex"
    monkeypatch.setenv("SPECD_PAGED_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="paged_attention must be one of auto, flex, gather"):
        parse_config(["serve", "--model", "org/m"]).engine_config()


def test_draft_layers_select_self_speculation_from_a_flag_a_variable_or_the_yaml(monkeypatch, tmp_path):
    cfg = parse_config(["serve", "--model", "org/m", "--speculative-method", "self", "--draft-layers", "2"])
    engine = cfg.engine_config()
    assert (engine.speculative_method.value, engine.draft_layers, engine.draft_model) == ("self", 2, None)
    # The embedded pair with self-speculation alone loads no draft model.
    assert parse_config(["serve", "--speculative-method", "self"]).engine_config().draft_model is None
    # Given alone, --draft-layers makes the default method hybrid (lookup + the early layers).
    assert parse_config(["serve", "--model", "org/m", "--draft-layers", "1"]).method == "hybrid"
    path = tmp_path / "c.yaml"
    path.write_text("model: org/m\nspeculative-method: self\ndraft-layers: 3\n")
    assert parse_config(["serve", "--config", str(path)]).engine_config().draft_layers == 3
    monkeypatch.setenv("SPECD_DRAFT_LAYERS", "0")
    with pytest.raises(ValueError, match="draft_layers must be >= 1"):
        parse_config(["serve", "--model", "org/m", "--speculative-method", "self"])
    monkeypatch.delenv("SPECD_DRAFT_LAYERS")
    with pytest.raises(ValueError, match="draft_layers is for speculative_method self or hybrid, not ngram"):
        parse_config(["serve", "--model", "org/m", "--speculative-method", "ngram", "--draft-layers", "1"])


def test_the_configuration_guide_lists_every_serve_option():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {o for a in serve._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    guide = (ROOT / "docs" / "configuration.md").read_text()
    table = guide[guide.index("<!-- options:begin -->") : guide.index("<!-- options:end -->")]
    listed = set(re.findall(r"`(--[a-z-]+)", table))
    assert flags <= listed, f"missing from docs/configuration.md's options table: {sorted(flags - listed)}"


def test_api_key_comes_from_the_environment_unless_given(monkeypatch):
    monkeypatch.setenv("SPECD_API_KEY", "from-env")
    assert parse_config(["serve", "--model", "org/m"]).api_key == "from-env"
    assert parse_config(["serve", "--model", "org/m", "--api-key", "flag"]).api_key == "flag"


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        ("modle: org/m\n", "unknown option 'modle'"),
        ("model: org/m\nport: eighty\n", "port must be int"),
        ("- a\n", "mapping"),
    ],
)
def test_bad_yaml_is_a_clear_error(tmp_path, yaml, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml)
    with pytest.raises(ConfigError, match=message):
        parse_config(["serve", "--config", str(path)])


def test_without_model_and_without_the_default_pair_exit_code_is_nonzero_with_a_hint(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(server.config, "DEFAULT_TARGET", tmp_path / "nope" / "target")
    monkeypatch.setattr(server.config, "DEFAULT_DRAFT", tmp_path / "nope" / "draft")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "default model pair is missing" in err and "--model" in err


def test_a_missing_local_model_path_is_reported_before_loading(capsys):
    assert main(["serve", "--model", "/no/such/model"]) == 2
    assert "--model /no/such/model does not exist" in capsys.readouterr().err


def test_example_configs_parse(monkeypatch):
    monkeypatch.setattr(server.config.ServerConfig, "check_models_exist", lambda self: None)
    names = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert "default.yaml" in names and any("8b" in n for n in names)
    for name in names:
        config = parse_config(["serve", "--config", str(ROOT / "configs" / name)])
        config.engine_config()
    gpu = parse_config(["serve", "--config", str(ROOT / "configs" / "llama-3.1-8b-gpu.yaml")])
    assert (gpu.dtype, gpu.device, gpu.method) == ("bfloat16", "cuda", "hybrid")


# ---- the real process ---------------------------------------------------------------------------------


class Process:
    def __init__(self, tmp_path: Path, args: list[str], **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "server.log"
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        script = ROOT / "tests" / "server" / "serve_with_faults.py"
        cmd = [sys.executable, str(script), "serve", "--port", str(self.port)]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd + args, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"exited early:\n{self.log.read_text()}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"not ready in {timeout}s:\n{self.log.read_text()}")

    def wait_exit(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"did not exit in {timeout}s:\n{self.log.read_text()}") from None


@pytest.fixture
def model_args(model_sets) -> list[str]:
    ms = model_sets["llama"]
    return ["--model", str(ms.target), "--draft-model", str(ms.draft), "--dtype", "float32", "--device", "cpu"]


def health_after_signal(url: str) -> int | str:
    """/health once the signal has landed: 503 (draining) or a refused connection (listener closed)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            status = httpx.get(url + "/health", timeout=1).status_code
        except httpx.TransportError:
            return "refused"
        if status != 200:
            return status
        time.sleep(0.02)
    return 200


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_drains_the_stream_in_flight_then_exits_0(tmp_path, model_args, sig):
    proc = Process(tmp_path, [*model_args, "--shutdown-timeout", "60"], SPECD_TEST_STEP_SLEEP="0.005")
    proc.wait_ready()
    body = {"prompt": "def", "max_tokens": 120, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        proc.proc.send_signal(sig)
        assert health_after_signal(proc.url) in (503, "refused")  # while the stream goes on
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data:")]
    assert events[-1] == "[DONE]" and '"completion_tokens":120' in events[-2]
    assert proc.wait_exit() == 0


def test_engine_crash_ends_the_process_with_a_nonzero_code(tmp_path, model_args):
    proc = Process(tmp_path, model_args, SPECD_TEST_CRASH_AFTER="3")
    proc.wait_ready()
    body = {"prompt": "def", "max_tokens": 50, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=30) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2]
    assert proc.wait_exit() == 1
    assert "injected engine crash" in proc.log.read_text()


def test_a_model_that_fails_to_load_ends_the_process_with_a_nonzero_code(tmp_path):
    (tmp_path / "not-a-model").mkdir()
    proc = Process(tmp_path, ["--model", str(tmp_path / "not-a-model"), "--device", "cpu"])
    assert proc.wait_exit(180) == 1
    assert "loading the model failed" in proc.log.read_text()


def test_token_healing_is_off_unless_a_flag_a_variable_or_the_yaml_turns_it_on(monkeypatch, tmp_path):
    assert parse_config(["serve", "--model", "org/m"]).token_healing is False
    assert parse_config(["serve", "--model", "org/m", "--token-healing"]).token_healing is True
    path = tmp_path / "c.yaml"
    path.write_text("model: org/m\ntoken-healing: true\n")
    assert parse_config(["serve", "--config", str(path)]).token_healing is True
    monkeypatch.setenv("SPECD_TOKEN_HEALING", "true")
    assert parse_config(["serve", "--model", "org/m"]).token_healing is True


def test_the_served_process_freezes_what_its_engine_is_built_of(tmp_path, model_args):
    """`serve` holds one engine for the process's life: garbage collection leaves out what it is built of."""
    proc = Process(tmp_path, model_args)
    proc.wait_ready()
    proc.proc.terminate()
    assert proc.wait_exit() == 0
    assert re.search(r"froze \d+ objects the engine keeps out of garbage collection", proc.log.read_text())

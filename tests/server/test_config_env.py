"""SPECD_* environment variables (how the Docker image and the Kubernetes manifests configure the
server) and --device-map: flags win over the YAML file, which wins over the environment."""

from __future__ import annotations

import dataclasses
import json

import pytest

from server.cli import parse_config
from server.config import ConfigError, ServerConfig, load_config, read_env


def test_every_option_has_an_environment_variable_converted_to_its_type():
    env = {
        "SPECD_MODEL": "/models/target",
        "SPECD_DRAFT_MODEL": "/models/draft",
        "SPECD_NUM_SPECULATIVE_TOKENS": "3",
        "SPECD_KV_CACHE_MEMORY_GB": "2.5",
        "SPECD_LOG_REQUESTS": "true",
        "SPECD_TRUST_REMOTE_CODE": "0",
        "SPECD_DEVICE_MAP": "auto",
        "SPECD_UNRELATED": "ignored",
    }
    config = load_config(environ=env)
    assert (config.model, config.draft_model, config.num_speculative_tokens) == ("/models/target", "/models/draft", 3)
    assert (config.kv_cache_memory_gb, config.log_requests, config.trust_remote_code) == (2.5, True, False)
    assert config.device_map == "auto" and config.engine_config().device_map == "auto"
    assert load_config(environ={"SPECD_NUM_SPECULATIVE_TOKENS": "adaptive"}).num_speculative_tokens is None
    names = {f"SPECD_{f.name.upper()}" for f in dataclasses.fields(ServerConfig)}
    assert {"SPECD_API_KEY", "SPECD_HOST", "SPECD_PORT", "SPECD_MAX_QUEUE"} <= names


def test_flags_win_over_yaml_which_wins_over_the_environment(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: org/yaml\nmax_num_seqs: 8\n")
    env = {"SPECD_MODEL": "org/env", "SPECD_MAX_NUM_SEQS": "4", "SPECD_PORT": "9100", "SPECD_API_KEY": "k"}
    config = load_config(str(path), {"max_num_seqs": 2}, environ=env)
    assert (config.model, config.max_num_seqs, config.port, config.api_key) == ("org/yaml", 2, 9100, "k")


def test_the_config_file_can_come_from_specd_config(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("model: org/from-file\n")
    monkeypatch.setenv("SPECD_CONFIG", str(path))
    assert parse_config(["serve"]).model == "org/from-file"
    other = tmp_path / "other.yaml"
    other.write_text("model: org/flag-file\n")
    assert parse_config(["serve", "--config", str(other)]).model == "org/flag-file"


def test_an_empty_variable_counts_as_unset():
    assert read_env({"SPECD_API_KEY": "", "SPECD_PORT": " "}) == {}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SPECD_PORT": "eighty"}, "SPECD_PORT must be int, got 'eighty'"),
        ({"SPECD_KV_CACHE_MEMORY_GB": "lots"}, "SPECD_KV_CACHE_MEMORY_GB must be float"),
        ({"SPECD_LOG_REQUESTS": "maybe"}, "SPECD_LOG_REQUESTS must be one of 1, true"),
        ({"SPECD_SPECULATIVE_METHOD": "magic"}, "speculative_method must be one of"),
    ],
)
def test_a_bad_environment_value_names_the_variable(env, message):
    with pytest.raises(ConfigError, match=message):
        load_config(environ={"SPECD_MODEL": "org/m", **env})


def test_device_map_flag_takes_a_strategy_or_json_and_reaches_the_engine_config():
    assert parse_config(["serve", "--model", "org/m", "--device-map", "balanced"]).engine_config().device_map == (
        "balanced"
    )
    mapping = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1, "lm_head": 1}
    config = parse_config(["serve", "--model", "org/m", "--device-map", json.dumps(mapping)])
    assert config.engine_config().device_map == mapping


def test_a_yaml_device_map_may_be_a_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: org/m\ndevice_map:\n  model.embed_tokens: 0\n  model.layers.0: 1\n  lm_head: 1\n")
    config = parse_config(["serve", "--config", str(path)])
    assert config.engine_config().device_map == {"model.embed_tokens": 0, "model.layers.0": 1, "lm_head": 1}


@pytest.mark.parametrize("value", ["everywhere", "{oops", '{"model.layers.0": 0, "lm_head": "cpu"}'])
def test_a_bad_device_map_flag_is_a_config_error_before_anything_loads(value):
    with pytest.raises(ConfigError, match="device_map"):
        parse_config(["serve", "--model", "org/m", "--device-map", value])

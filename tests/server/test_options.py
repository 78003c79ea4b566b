"""Every option is declared once (ServerConfig's fields) and its flag, SPECD_* variable, YAML key, docs row and
EngineConfig keyword are derived from that declaration: these tests fail when one of them drifts."""

from __future__ import annotations

import dataclasses

import pytest

from server.cli import build_parser, parse_config
from server.config import ConfigError, ServerConfig, read_env, read_yaml
from server.options import Spec, specs
from server.options_docs import DOC, documented, render

# EngineConfig fields the server does not expose: tuning knobs of the library and the tests.
LIBRARY_ONLY = {"exit_head", "ngram_max", "ngram_min", "block_size", "num_kv_blocks", "freeze_heap"}


def sample(spec: Spec) -> tuple[str, object]:
    """A value other than the default, as text and as the option's value."""
    if spec.kind is bool:
        return ("false", False) if spec.default is True else ("true", True)
    if spec.option.choices:
        choice = next(c for c in reversed(spec.option.choices) if c != spec.default)
        return choice, choice
    return {int: ("3", 3), float: ("2.5", 2.5), str: ("some/text", "some/text")}[spec.kind]


def test_the_docs_options_table_is_rendered_from_the_declaration():
    assert documented(DOC.read_text()) == render(), "run: python -m server.options_docs --write"


@pytest.mark.parametrize("spec", specs(ServerConfig), ids=lambda s: s.name)
def test_each_option_reads_the_same_from_its_flag_its_variable_and_its_yaml_key(spec, tmp_path):
    text, value = sample(spec)
    argv = [spec.flag_for(value)] if spec.kind is bool else [spec.flag, text]
    assert vars(build_parser().parse_args(["serve", *argv]))[spec.name] == value
    assert spec.env == "SPECD_" + spec.name.upper() and read_env({spec.env: text}) == {spec.name: value}
    for key in (spec.name, spec.name.replace("_", "-")):
        path = tmp_path / "c.yaml"
        path.write_text(f"{key}: {text}\n")
        assert read_yaml(str(path)) == {spec.name: value}


def test_words_that_mean_unset_and_bare_flags_are_declared_not_special_cased():
    assert read_env({"SPECD_NUM_SPECULATIVE_TOKENS": "adaptive"}) == {"num_speculative_tokens": None}
    assert vars(build_parser().parse_args(["serve", "--num-speculative-tokens", "auto"]))["num_speculative_tokens"] \
        is None
    assert vars(build_parser().parse_args(["serve", "--compile"]))["compile"] == "start"


def test_every_switch_turns_either_way_on_the_command_line_over_the_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: org/m\nprefix-caching: false\ntoken-healing: true\n")
    config = parse_config(["serve", "--config", str(path), "--prefix-caching", "--no-token-healing"])
    assert (config.prefix_caching, config.token_healing) == (True, False)


def test_every_choice_is_named_in_the_options_help():
    for spec in specs(ServerConfig):
        for choice in spec.option.choices:
            assert f"`{choice}`" in spec.option.help, (spec.name, choice)


def test_engine_options_are_engine_config_fields_with_the_same_defaults():
    from engine import EngineConfig

    engine_fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    passed_on = {spec.name: spec for spec in specs(ServerConfig) if spec.option.engine}
    assert set(passed_on) <= set(engine_fields)
    assert set(engine_fields) - set(passed_on) == LIBRARY_ONLY
    # The server resolves the model and the method itself, and compiles by default where it pays; the library
    # compiles nothing unless asked.
    for name in passed_on.keys() - {"model", "speculative_method", "compile"}:
        assert passed_on[name].default == engine_fields[name].default, name


@pytest.mark.parametrize(
    ("argv", "env", "yaml", "message"),
    [
        (["--max-queue", "0"], {}, "", r"max_queue must be >= 1, got 0 \(from --max-queue\)"),
        ([], {"SPECD_MAX_QUEUE": "0"}, "", r"max_queue must be >= 1, got 0 \(from SPECD_MAX_QUEUE\)"),
        ([], {}, "max-queue: 0\n", r"max_queue must be >= 1, got 0 \(from config file .*c.yaml\)"),
        ([], {}, "max_queue: lots\n", r"max_queue must be int, got 'lots' \(from config file .*c.yaml\)"),
        ([], {"SPECD_LOG_LEVEL": "loud"}, "", r"log_level must be one of debug, info, warning, error, got 'loud' "
         r"\(from SPECD_LOG_LEVEL\)"),
        # EngineConfig's own checks, told where the value came from too.
        ([], {"SPECD_NUM_SPECULATIVE_TOKENS": "17"}, "", r"num_speculative_tokens must be in \[0, 16\], got 17 "
         r"\(from SPECD_NUM_SPECULATIVE_TOKENS\)"),
        (["--max-lookup-tokens", "32"], {}, "", r"max_lookup_tokens must be in \[1, 31\], got 32 "
         r"\(from --max-lookup-tokens\)"),
        (["--device-map", "everywhere"], {}, "", r"device_map must be one of .* \(from --device-map\)"),
    ],
)
def test_a_refused_value_names_the_option_and_where_it_came_from(monkeypatch, tmp_path, argv, env, yaml, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "c.yaml"
    path.write_text("model: org/m\n" + yaml)
    with pytest.raises(ConfigError, match=message):
        parse_config(["serve", "--config", str(path), *argv])


def test_a_flag_of_the_wrong_type_is_refused_by_the_parser_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--port", "eighty"])
    assert "argument --port: must be int, got 'eighty'" in capsys.readouterr().err


def test_llm_takes_engine_config_fields_by_name_and_refuses_others():
    from engine import EngineConfig, SpeculativeMethod
    from engine.llm import engine_config

    every = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    assert engine_config("m", every) == EngineConfig(model="m", **every)
    assert engine_config("m", {"draft_model": "d"}).speculative_method is SpeculativeMethod.HYBRID
    assert engine_config("m", {"draft_layers": 2}).speculative_method is SpeculativeMethod.HYBRID
    assert engine_config("m", {}).speculative_method is SpeculativeMethod.NONE
    with pytest.raises(TypeError, match="unknown options draft_modle"):
        engine_config("m", {"draft_modle": "d"})

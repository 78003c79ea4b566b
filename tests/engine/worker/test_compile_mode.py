"""Which compile mode an engine runs with: auto compiles in the background only where it measured faster
(float32 on CPU, with the C++ compiler inductor needs), and background becomes start where the forwards
cannot be compiled beside serving."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import CompileMode, EngineConfig
from engine.worker.compiled import resolve_mode

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_the_config_takes_a_mode_its_value_or_a_bool_and_names_the_field_when_wrong():
    assert EngineConfig(model="m").compile is CompileMode.OFF  # the library's default: LLM() compiles nothing
    assert EngineConfig(model="m", compile=True).compile is CompileMode.START
    assert EngineConfig(model="m", compile=False).compile is CompileMode.OFF
    assert EngineConfig(model="m", compile="background").compile is CompileMode.BACKGROUND
    with pytest.raises(ValueError, match="compile must be one of off, start, background, auto, got 'later'"):
        EngineConfig(model="m", compile="later")


def test_auto_compiles_in_the_background_on_cpu_in_float32_with_a_compiler(monkeypatch, caplog):
    caplog.set_level(logging.INFO, "engine.worker.compiled")
    monkeypatch.setenv("CXX", "sh")  # any program on PATH stands for the compiler inductor looks up
    assert resolve_mode(CompileMode.AUTO, CPU, torch.float32, split=False, eagle=False) is CompileMode.BACKGROUND
    elsewhere = ((CPU, torch.bfloat16, False), (CUDA, torch.bfloat16, False), (CPU, torch.float32, True))
    for device, dtype, split in elsewhere:
        assert resolve_mode(CompileMode.AUTO, device, dtype, split, eagle=False) is CompileMode.OFF
    monkeypatch.setenv("CXX", "no-such-compiler-for-specd")
    assert resolve_mode(CompileMode.AUTO, CPU, torch.float32, split=False, eagle=False) is CompileMode.OFF
    assert "no C++ compiler 'no-such-compiler-for-specd'" in caplog.text


def test_background_becomes_start_where_it_cannot_run_beside_serving_and_the_others_stay():
    assert resolve_mode(CompileMode.BACKGROUND, CPU, torch.float32, False, False) is CompileMode.BACKGROUND
    assert resolve_mode(CompileMode.BACKGROUND, CUDA, torch.bfloat16, False, False) is CompileMode.START
    assert resolve_mode(CompileMode.BACKGROUND, CPU, torch.float32, True, False) is CompileMode.START
    assert resolve_mode(CompileMode.BACKGROUND, CPU, torch.float32, False, True) is CompileMode.START
    for mode in (CompileMode.OFF, CompileMode.START):
        assert resolve_mode(mode, CUDA, torch.bfloat16, True, True) is mode


def test_what_runs_after_a_background_compile_sees_the_compiled_forwards_and_a_failure_is_only_logged(caplog):
    """Jobs given to ``then`` run in the compile's thread once every model serves compiled (the goodput
    controller's profile is taken again there); one that fails is logged, and the compile stays done."""
    from engine.worker.compiled import BackgroundWarmUp, CompiledForward

    forward = CompiledForward(torch.nn.Linear(2, 2), "tiny")
    seen: list[object] = []

    def later() -> None:
        seen.append(forward.warming_in)
        raise RuntimeError("a profile that failed")

    background = BackgroundWarmUp([(forward, lambda: None)])
    background.then(later)
    background.then(lambda: seen.append(forward.state))
    assert background.start().join(timeout=60)
    assert seen == [None, "compiled"]
    assert "after the background compile" in caplog.text and "a profile that failed" in caplog.text

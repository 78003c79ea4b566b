"""SamplingParams validation: every range error names its field."""

from __future__ import annotations

import math

import pytest

from engine.types.errors import SamplingParamError
from engine.types.sampling_params import SamplingParams


def test_defaults_are_valid_and_mean_plain_sampling():
    p = SamplingParams()
    assert p.max_tokens >= 1
    assert not p.greedy
    assert not p.uses_penalties
    assert not p.truncates
    assert p.stop == () and p.stop_token_ids == () and p.logit_bias == {}


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 2, "token_healing": True}, "prompt_logprobs"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": -0.01}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"presence_penalty": 2.1}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"frequency_penalty": 2.1}, "frequency_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: -101.0}}, "logit_bias"),
        ({"logit_bias": {5: math.nan}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
    ],
)
def test_out_of_range_value_raises_an_error_naming_the_field(kwargs, param):
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert str(info.value).startswith(f"{param}:")


def test_sampling_param_error_is_a_value_error():
    with pytest.raises(ValueError):
        SamplingParams(top_k=-3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1},
        {"temperature": 0.0},
        {"temperature": 2.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"presence_penalty": 2.0, "frequency_penalty": -2.0},
        {"logit_bias": {0: -100.0, 7: 100.0}},
        {"min_tokens": 16, "max_tokens": 16},
        {"logprobs": 0},
        {"logprobs": 20},
        {"num_speculative_tokens": 0},
        {"num_speculative_tokens": 16},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_lists_are_stored_as_tuples_and_a_single_stop_string_is_wrapped():
    p = SamplingParams(stop="###", stop_token_ids=[3, 4])
    assert p.stop == ("###",)
    assert p.stop_token_ids == (3, 4)
    q = SamplingParams(stop=["a", "b"])
    assert q.stop == ("a", "b") and isinstance(q.stop, tuple)


def test_logit_bias_keys_from_json_strings_become_ints():
    p = SamplingParams(logit_bias={"5": 1, "17": -2.5})
    assert p.logit_bias == {5: 1.0, 17: -2.5}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())


def test_derived_flags_follow_the_values():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(presence_penalty=0.5).uses_penalties
    assert SamplingParams(frequency_penalty=-0.5).uses_penalties
    assert SamplingParams(top_k=5).truncates
    assert SamplingParams(top_p=0.9).truncates
    assert SamplingParams(min_p=0.1).truncates

"""token_healing over HTTP: accepted on both routes, a bad type or a combination with structured output is
a 400 naming it, and --token-healing makes it the default of requests that leave it unset."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from tests.server.conftest import MODEL
from tests.server.test_errors import error_of

pytestmark = pytest.mark.timeout(120)

MERGED = "\n   "  # one token in the tiny tokenizer
PROMPT = "def fib(n):\n"


def merged_bias(tokenizer_dir) -> dict[str, float]:
    """Makes the merged token the model's choice: with healing it stands for the prompt's own newline."""
    return {str(PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).encode(MERGED)[0]): 100.0}


def test_token_healing_is_accepted_on_completions_and_never_repeats_the_prompts_end(server, tokenizer_dir):
    client = server.client()
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias=merged_bias(tokenizer_dir))
    healed = client.completions.create(**body, extra_body={"token_healing": True})
    plain = client.completions.create(**body)
    assert healed.choices[0].text.startswith("   ") and plain.choices[0].text.startswith(MERGED)
    assert healed.usage.prompt_tokens == plain.usage.prompt_tokens
    assert healed.usage.completion_tokens == 4


def test_token_healing_is_accepted_on_chat(server):
    out = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_body={"token_healing": True},
    )
    assert out.usage.completion_tokens >= 1


@pytest.mark.parametrize("bad", ["maybe", [1], {"a": 1}])
def test_a_token_healing_that_is_not_a_boolean_is_a_400(server, bad):
    resp = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "token_healing": bad})
    assert error_of(resp, 400)["param"] == "token_healing"


def test_token_healing_with_structured_output_is_a_400_naming_it(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "token_healing": True, "guided_regex": "[a-z]+"}
    assert error_of(server.post("/v1/completions", body), 400)["param"] == "token_healing"


def test_the_server_flag_makes_healing_the_default_unless_a_request_turns_it_off(make_server, tokenizer_dir):
    live = make_server(token_healing=True)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
            "logit_bias": merged_bias(tokenizer_dir)}
    assert live.post("/v1/completions", body).json()["choices"][0]["text"].startswith("   ")
    off = live.post("/v1/completions", {**body, "token_healing": False}).json()
    assert off["choices"][0]["text"].startswith(MERGED)
    # The default never lands on a structured request (where it would be refused).
    regex = live.post("/v1/completions", {**body, "guided_regex": "[a-z]+", "logit_bias": {}})
    assert regex.status_code == 200, regex.text

"""The shipped default pair: present, small, in bf16 safetensors, lossless through the engine on held-out
code, and what `specd serve` answers with when given no model flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from recipe.evaluate import held_out_prompts
from server.config import DEFAULT_DRAFT, DEFAULT_TARGET
from tests.engine.lossless import Reference, assert_same_as_target
from tests.server.test_cli import free_port

PAIR = DEFAULT_TARGET.parent
ROOT = Path(__file__).resolve().parents[2]


def test_the_pair_is_committed_in_transformers_format_under_50_mb():
    total = sum(f.stat().st_size for f in PAIR.rglob("*") if f.is_file())
    assert total <= 50 * 2**20, f"models/default holds {total / 2**20:.1f} MB"
    for d in (DEFAULT_TARGET, DEFAULT_DRAFT):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (d / name).is_file(), d / name
        assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
    assert (DEFAULT_TARGET / "tokenizer.json").read_bytes() == (DEFAULT_DRAFT / "tokenizer.json").read_bytes()
    target, draft = (json.loads((d / "training.json").read_text())["params"] for d in (DEFAULT_TARGET, DEFAULT_DRAFT))
    assert 10e6 <= target <= 20e6 and draft * 8 <= target


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_TARGET)


def test_greedy_speculation_with_the_shipped_pair_equals_the_target_alone_on_held_out_code(tokenizer):
    prompts = held_out_prompts(tokenizer, 4, prompt_tokens=64)
    ref = Reference(DEFAULT_TARGET, eos=tokenizer.eos_token_id)
    llm = LLM(str(DEFAULT_TARGET), draft_model=str(DEFAULT_DRAFT), speculative_method="draft_model",
              num_speculative_tokens=4, dtype="float32", device="cpu")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    for p, out in zip(prompts, outs):
        assert len(out.token_ids) > 0
        assert_same_as_target(ref, p, list(out.token_ids), "default pair k=4")
    stats = llm.stats()
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.3  # a trained pair agrees; random ones do not


def test_the_shipped_exit_head_drafts_the_targets_output_better_than_its_own_head(tokenizer):
    """models/default/target/exit_head (specd distill --method self): lossless, and a trained exit is accepted
    more often than the untrained one at the same depth."""
    prompts = held_out_prompts(tokenizer, 4, prompt_tokens=64)
    ref = Reference(DEFAULT_TARGET, eos=tokenizer.eos_token_id)
    acceptance = {}
    for trained in (True, False):
        llm = LLM(str(DEFAULT_TARGET), speculative_method="self", draft_layers=1, exit_head=trained,
                  num_speculative_tokens=4, dtype="float32", device="cpu")
        for p, out in zip(prompts, llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))):
            assert_same_as_target(ref, p, list(out.token_ids), f"self, exit head {trained}")
        acceptance[trained] = llm.stats().acceptance_rate
    assert acceptance[True] > 1.5 * acceptance[False], acceptance  # 0.24 against 0.14 on these prompts


def test_the_chat_template_renders_messages_for_the_code_model_to_continue(tokenizer):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "def add(a, b):"


@pytest.mark.timeout(120)
def test_specd_serve_with_no_model_flags_serves_the_default_pair(tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "server", "serve", "--port", str(port)],
                                cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        (model,) = client.models.list().data
        assert model.id == "specd-default"
        done = client.completions.create(model=model.id, prompt="def fibonacci(n):\n", max_tokens=24, temperature=0)
        assert done.choices[0].text.strip() and done.usage.completion_tokens > 0
        chat = client.chat.completions.create(
            model=model.id, messages=[{"role": "user", "content": "import os"}], max_tokens=16, temperature=0
        )
        assert chat.choices[0].message.content
    finally:
        proc.terminate()
        proc.wait(30)

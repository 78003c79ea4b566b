"""``specd serve --tensor-parallel-size 2`` as a user runs it: the real command, which starts its second rank
itself. The openai-client tests of /v1/completions and /v1/chat/completions run against it unchanged (imported
below, with this module's ``server``); its greedy output is the target's own; a clean stop stops both ranks (exit
0), and a lost rank takes the server down (exit 1, a log line naming it), never a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.engine.lossless import MAX_NEW, Reference, assert_same_as_target, prompts_for
from tests.server.conftest import MODEL
from tests.server.test_chat import (  # noqa: F401 - collected here, against this module's server
    test_chat_logprobs_have_tokens_bytes_and_top_alternatives,
    test_chat_renders_the_template_and_answers_like_the_completion_of_that_text,
    test_max_completion_tokens_wins_and_the_default_is_the_rest_of_the_context,
    test_streamed_chat_opens_with_the_role_and_ends_with_usage,
    test_text_content_parts_are_joined,
)
from tests.server.test_cli import ROOT, Process, free_port
from tests.server.test_completions import (  # noqa: F401 - collected here, against this module's server
    test_a_completion_ending_inside_an_incomplete_character_keeps_its_text,
    test_completion_has_openai_fields_and_usage_with_spec_counts,
    test_default_max_tokens_is_16,
    test_echo_prepends_the_prompt_and_its_first_token_alone_gets_a_null_logprob,
    test_list_prompts_give_n_choices_each_in_prompt_order,
    test_logprobs_follow_the_legacy_format_and_streaming_gives_the_same,
    test_models_health_and_metrics,
    test_n_choices_are_separate_requests_with_their_own_index,
    test_num_speculative_tokens_zero_turns_drafting_off_for_the_request,
    test_return_token_ids_extension,
    test_seed_reproduces_a_sample_and_n_choices_use_seed_plus_index,
    test_stop_string_ends_the_text_before_it,
    test_stream_concatenates_to_the_plain_completion_and_reports_usage_last,
    test_stream_options_without_stream_is_refused_by_name,
    test_token_id_prompts_equal_their_text,
)


class TwoRankServer:
    """``specd serve --tensor-parallel-size 2`` in a process of its own, with what the imported tests use of the
    in-process LiveServer (tests.server.conftest): clients, HTTP, metrics and the tokenizer."""

    def __init__(self, proc: Process, target: str) -> None:
        self.proc, self.url, self.api_key = proc, proc.url, "unused"
        models = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]
        self.engine = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(target),
                                      max_model_len=models["max_model_len"])

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0, timeout=60, **kw)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10)

    def post(self, path: str, body: object, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=kw.pop("timeout", 30), **kw)

    def metric(self, name: str, **labels: str) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in self.get("/metrics").text.splitlines()
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())
        )


def start(chat_target, draft, tmp) -> Process:
    """The shared server's configuration (tests.server.conftest: the llama target, its draft, 4 drafts a step)."""
    proc = Process(tmp, [
        "--model", str(chat_target), "--draft-model", str(draft), "--speculative-method", "draft_model",
        "--num-speculative-tokens", "4", "--dtype", "float32", "--device", "cpu", "--tensor-parallel-size", "2",
        "--served-model-name", MODEL, "--compile", "off",
    ])
    proc.wait_ready()
    return proc


@pytest.fixture(scope="module")
def server(model_sets, chat_target, tmp_path_factory):
    proc = start(chat_target, model_sets["llama"].draft, tmp_path_factory.mktemp("tp-server"))
    yield TwoRankServer(proc, str(chat_target))
    if proc.proc.poll() is None:
        proc.proc.kill()


def worker_pids(proc: Process) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(proc.proc.pid), "-f", "engine.parallel"], capture_output=True,
                         text=True)
    return [int(p) for p in out.stdout.split()]


def test_concurrent_completions_from_two_ranks_equal_the_target_alone(server, model_sets, tokenizer_dir):
    ref = Reference(model_sets["llama"].target)
    prompts = prompts_for(tokenizer_dir)

    def complete(prompt: list[int]) -> openai.types.Completion:
        return server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0.0,
                                                  extra_body={"return_token_ids": True})

    with ThreadPoolExecutor(len(prompts)) as pool:  # one batch across the ranks, as concurrent users make one
        answers = list(pool.map(complete, prompts))
    for prompt, resp in zip(prompts, answers):
        assert_same_as_target(ref, prompt, resp.choices[0].model_extra["token_ids"], "2 ranks over HTTP")
    assert sum(r.usage.model_extra["spec_draft_tokens"] for r in answers) > 0, "nothing was drafted"


def test_sigterm_drains_rank_0_which_then_stops_the_other_rank_cleanly(model_sets, chat_target, tmp_path):
    proc = start(chat_target, model_sets["llama"].draft, tmp_path)
    assert len(worker_pids(proc)) == 1, proc.log.read_text()
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.wait_exit() == 0, proc.log.read_text()
    assert "tensor-parallel rank 1: stopped by rank 0" in proc.log.read_text()


def test_under_torchrun_every_rank_runs_the_same_command_and_rank_0_serves(model_sets, tokenizer_dir, tmp_path):
    ms, port = model_sets["llama"], free_port()
    log = tmp_path / "torchrun.log"
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2", "-m", "server", "serve",
           "--model", str(ms.target), "--dtype", "float32", "--device", "cpu", "--tensor-parallel-size", "2",
           "--speculative-method", "ngram", "--num-speculative-tokens", "4", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not _healthy(url):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        ref = Reference(ms.target)
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt in prompts_for(tokenizer_dir)[4:]:
            resp = c.completions.create(model=ms.target.name, prompt=prompt, max_tokens=MAX_NEW, temperature=0.0,
                                        extra_body={"return_token_ids": True})
            assert_same_as_target(ref, prompt, resp.choices[0].model_extra["token_ids"], "2 ranks under torchrun")
        assert "tensor-parallel rank 1 of 2 on cpu: following rank 0" in log.read_text()
    finally:
        proc.terminate()  # torchrun passes it to both ranks: rank 0 drains, then stops rank 1
        proc.wait(60)
    assert "tensor-parallel rank 1: stopped by rank 0" in log.read_text(), log.read_text()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_a_lost_rank_takes_the_server_down_with_exit_1_and_a_line_naming_it(model_sets, chat_target, tmp_path):
    proc = start(chat_target, model_sets["llama"].draft, tmp_path)
    (worker,) = worker_pids(proc)
    subprocess.run(["kill", "-9", str(worker)], check=True)
    assert proc.wait_exit(timeout=60) == 1, proc.log.read_text()
    assert "tensor-parallel rank 1 exited with code -9" in proc.log.read_text()

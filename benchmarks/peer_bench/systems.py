"""The systems compared: HTTP servers started as child processes, and transformers' generate() in a
child worker. All load the same weights in the same dtype (float32 on CPU, bfloat16 on CUDA); llama.cpp's
server loads them converted to f32 GGUF (benchmarks/llamacpp/convert.py), on CPU only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from .ports import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@dataclass(frozen=True)
class System:
    name: str
    kind: str  # "server" (OpenAI HTTP API) or "generate" (hf_worker.py, batch 1 only)
    args: tuple[str, ...]  # server: the command after the interpreter; generate: hf_worker.py flags
    speculative: bool = False  # specd with a drafter: acceptance and the bound apply
    binary: str | None = None  # a native server, run as is rather than under this interpreter
    default: bool = True  # run when --systems names no systems
    cwd: Path | None = None  # another checkout to run it from (compare.py --base-tree), else this one


LLAMACPP = ("llama.cpp spec", "llama.cpp none")
# llama.cpp's draft settings. --spec-type must be given: with only -md, this llama.cpp loads the draft
# and never drafts. The rest are llama.cpp's defaults, spelled out: 3 drafts per step at most, drafting
# never cut short by the draft's confidence (p-min 0). On the embedded pair, of n-max 3/4/8 and p-min
# 0/0.5/0.75 these are within noise of the best at concurrency 8 and 32 (where no setting makes drafting
# pay) and 8% behind n-max 8 at 1 (benchmarks/llamacpp/draft_sweep.py; benchmarks/results/llamacpp_draft_sweep.json).
LLAMACPP_DRAFT = ("--spec-type", "draft-simple", "--spec-draft-n-max", "3", "--spec-draft-n-min", "0",
                  "--spec-draft-p-min", "0.0")


def alone(draft: str) -> list[tuple[str, tuple[str, ...]]]:
    """(name, flags) of each speculative method by itself; eagle with the head beside the draft (the embedded
    pair's models/default/eagle), self with the target's own exit head."""
    out = [("draft", ("--draft-model", draft, "--speculative-method", "draft_model")),
           ("ngram", ("--speculative-method", "ngram")), ("suffix", ("--speculative-method", "suffix")),
           ("self", ("--speculative-method", "self"))]
    head = Path(draft).parent / "eagle"
    if head.is_dir():
        out.append(("eagle", ("--draft-model", str(head), "--speculative-method", "eagle")))
    return out


def systems(target: str, draft: str, device: str) -> list[System]:
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    specd = ("-m", "server", "serve", "--model", target, "--dtype", dtype, "--device", device, "--max-num-seqs", "64")
    eager = ("--compile", "off")  # the server's default compiles in the background where it pays (CPU, float32)
    ts = ("-m", "transformers.cli.transformers", "serve", target, "--device", device, "--dtype", dtype)
    gen = ("--target", target, "--device", device)
    return [
        System("specd adaptive", "server", (*specd, "--draft-model", draft, "--speculative-method", "hybrid", *eager),
               speculative=True),
        System("specd draft", "server",
               (*specd, "--draft-model", draft, "--speculative-method", "draft_model", *eager), speculative=True),
        System("specd adaptive compiled", "server",
               (*specd, "--draft-model", draft, "--speculative-method", "hybrid", "--compile"),
               speculative=True, default=False),
        # The server as it starts with no --compile flag: measured once its background compile is done.
        System("specd adaptive default", "server", (*specd, "--draft-model", draft, "--speculative-method", "hybrid"),
               speculative=True, default=False),
        System("specd none", "server", (*specd, "--speculative-method", "none", *eager)),
        System("specd none compiled", "server", (*specd, "--speculative-method", "none", "--compile"), default=False),
        System("specd ngram", "server", (*specd, "--speculative-method", "ngram", *eager), speculative=True),
        # Each source alone under the goodput controller, compiled: beside "specd none compiled", what each
        # brings by itself (the default combines them per sequence and step).
        *(System(f"specd {name} compiled", "server", (*specd, *how, "--compile"), speculative=True, default=False)
          for name, how in alone(draft)),
        System("transformers serve", "server", ts),
        System("transformers serve --cb", "server", (*ts, "--continuous-batching")),
        System("generate assisted", "generate", (*gen, "--mode", "assisted", "--draft", draft)),
        System("generate prompt lookup", "generate", (*gen, "--mode", "lookup")),
    ]


def llamacpp_missing(device: str) -> str | None:
    """Why llama.cpp's server cannot run here, or None."""
    from llamacpp.convert import server_binary  # benchmarks/ is on sys.path (compare.py puts it there)

    if device != "cpu":
        return f"the llama-server build is CPU-only and the others run on {device}"
    if not server_binary().exists():
        return f"no {server_binary()}: run benchmarks/llamacpp/build.sh (or set LLAMA_SERVER)"
    return None


def llamacpp_systems(target: str, draft: str, threads: int, slots: int,
                     draft_settings: tuple[str, ...] = LLAMACPP_DRAFT) -> list[System]:
    """llama-server with and without the draft, converting both checkpoints to GGUF on first use.
    One slot per concurrent request, each with the target's context; greedy comes from the request
    (temperature 0), as for every other system."""
    from llamacpp.convert import gguf_for, server_binary

    max_model_len = json.loads((Path(target) / "config.json").read_text()).get("max_position_embeddings", 2048)
    common = ("-m", str(gguf_for(target)), "-t", str(threads), "-tb", str(threads), "--parallel", str(slots),
              "-c", str(slots * max_model_len), "--no-kv-unified", "--metrics", "--no-webui", "-lv", "2")
    spec = ("-md", str(gguf_for(draft)), "-td", str(threads), "-tbd", str(threads), *draft_settings)
    binary = str(server_binary())
    return [System("llama.cpp spec", "server", (*common, *spec), binary=binary),
            System("llama.cpp none", "server", common, binary=binary)]


class Running:
    """One started system. Servers are probed on /health; generate workers say they are ready."""

    def __init__(self, system: System, log_dir: Path) -> None:
        self.system = system
        self.port = free_port()
        self.log = open(log_dir / (system.name.replace(" ", "_").replace("-", "") + ".log"), "w")  # noqa: SIM115
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        if system.binary:
            cmd = [system.binary, *system.args, "--host", "127.0.0.1", "--port", str(self.port)]
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        elif system.kind == "server":
            cmd = [sys.executable, *system.args, "--port", str(self.port)]
            if "transformers" not in system.args[1]:
                cmd += ["--host", "127.0.0.1"]
            else:
                cmd += ["--host", "127.0.0.1", "--log-level", "warning"]
            self.proc = subprocess.Popen(cmd, cwd=system.cwd or ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                         env=env)
        else:
            cmd = [sys.executable, str(HERE / "hf_worker.py"), *system.args]
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self.log, env=env, text=True)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.model_id = ""

    def _model_id(self) -> str:
        """The served model's id; `transformers serve` answers with the path it was given (and its
        /v1/models lists the Hub cache, which may not exist)."""
        if not self.system.binary and "transformers" in self.system.args[1]:
            return self.system.args[3]
        return httpx.get(self.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until the server is ready and done compiling (/health's "compile" is not "compiling"). ``timeout``: by
        default 300 s, and 1800 s for a system that compiles, whose first start on a machine compiles every
        warm-up layout (10-15 min for the default pair on 2 cores; a later start reads inductor's cache)."""
        if timeout is None:
            args = self.system.args
            specd = args[:2] == ("-m", "server")
            eager = "--compile" in args and args[args.index("--compile") + 1 :][:1] == ("off",)
            timeout = 1800.0 if specd and not eager else 300.0
        deadline = time.monotonic() + timeout
        if self.system.kind == "generate":
            line = self.proc.stdout.readline()
            if not line or not json.loads(line).get("ready"):
                raise RuntimeError(f"{self.system.name} did not start; see {self.log.name}")
            return
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.system.name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                health = httpx.get(self.base_url + "/health", timeout=2)
                if health.status_code == 200 and health.json().get("compile") != "compiling":
                    self.model_id = self._model_id()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.system.name} not ready after {timeout:.0f} s; see {self.log.name}")

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[dict]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_new_tokens": max_new_tokens}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.system.name} worker died; see {self.log.name}")
        return json.loads(line)["results"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

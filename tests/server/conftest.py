"""Live servers on 127.0.0.1 (uvicorn in a background thread) over tiny random models."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from engine import EngineConfig, LLMEngine
from server.app import create_app
from server.config import ServerConfig

# Renders "<|bos|>role: content\n" per message, then "assistant:" when a reply is wanted.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MODEL = "tiny-llama"


class LiveServer:
    """create_app + uvicorn on a free port, in a thread; ``fatal`` records what on_fatal was told."""

    def __init__(
        self, config: ServerConfig, engine: LLMEngine, factory: Callable[[], LLMEngine] | None = None
    ) -> None:
        self.engine = engine
        self.fatal: list[BaseException] = []
        self.app = create_app(config, engine_factory=factory or (lambda: engine), on_fatal=self.fatal.append)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = config.api_key or "unused"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        if factory is None:
            self.wait_ready()

    def wait_ready(self) -> None:
        self.wait_until(lambda: self.get("/health").status_code == 200, what="the server to become ready")

    @property
    def state(self):
        return self.app.state.specd

    @property
    def async_engine(self):
        return self.state.serving.async_engine

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", self.api_key), max_retries=0, **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0, timeout=60)

    def get(self, path: str) -> httpx.Response:
        try:
            return httpx.get(self.url + path, timeout=10)
        except httpx.TransportError:
            return httpx.Response(599)

    def post(self, path: str, body: object, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=kw.pop("timeout", 30), **kw)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the /metrics samples called ``name`` that carry ``labels`` (0 if none): a counter
        labelled by draft ``method`` sums over the methods unless one is named."""
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in self.get("/metrics").text.splitlines()
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())
        )

    def wait_idle(self, timeout: float = 5.0) -> None:
        """The engine has nothing running or waiting and every KV block is free."""
        e = self.engine
        self.wait_until(
            lambda: e.num_running == 0 and e.num_waiting == 0 and e.block_manager.usage == 0,
            timeout, "the engine to free every request",
        )

    @staticmethod
    def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "a condition") -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(15)


def tiny_engine(target: Path, draft: Path | None = None, k: int | None = 4, **kw) -> LLMEngine:
    method = "draft_model" if draft is not None else "none"
    return LLMEngine(
        EngineConfig(
            model=str(target),
            draft_model=str(draft) if draft is not None else None,
            speculative_method=method,
            num_speculative_tokens=k if draft is not None else None,
            dtype="float32",
            device="cpu",
            **kw,
        )
    )


@pytest.fixture(scope="session")
def chat_target(model_sets, tmp_path_factory) -> Path:
    """The llama target, with a chat template added to its tokenizer (the tiny tokenizer has none)."""
    out = tmp_path_factory.mktemp("chat") / "tiny-llama"
    shutil.copytree(model_sets["llama"].target, out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out


@pytest.fixture(scope="session")
def server(model_sets, chat_target) -> Iterator[LiveServer]:
    """The shared server: llama target with its noisy draft, 4 drafts per step."""
    engine = tiny_engine(chat_target, model_sets["llama"].draft, k=4)
    live = LiveServer(ServerConfig(model=str(chat_target), draft_model=str(model_sets["llama"].draft)), engine)
    yield live
    live.stop()


@pytest.fixture
def make_server(model_sets) -> Iterator[Callable[..., LiveServer]]:
    """A private server (for tests that break, slow down or reconfigure it), stopped afterwards."""
    started: list[LiveServer] = []

    def make(engine: LLMEngine | None = None, factory: Callable[[], LLMEngine] | None = None, **config) -> LiveServer:
        ms = model_sets["llama"]
        engine = engine or tiny_engine(ms.target)
        config.setdefault("served_model_name", MODEL)
        live = LiveServer(ServerConfig(model=str(ms.target), **config), engine, factory)
        started.append(live)
        return live

    yield make
    for live in started:
        live.stop()


def slow_steps(monkeypatch: pytest.MonkeyPatch, engine: LLMEngine, seconds: float) -> None:
    """Make every engine step take at least ``seconds``, so a request is reliably still running."""
    step = engine.step

    def slow() -> list:
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", slow)

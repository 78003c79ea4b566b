"""The FastAPI app: its state, start-up (the engine loads in the background while /health says
"loading"), shutdown (draining), routes (server.routes) and middleware."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from engine import LLMEngine
from server import errors, routes
from server.async_engine import AsyncEngine
from server.compile_metrics import declare_compile
from server.config import ServerConfig
from server.logprobs import TokenText
from server.metrics import draft_methods
from server.middleware import BodySizeLimit
from server.serving import Limits, Serving
from server.state import AppState

logger = logging.getLogger(__name__)


def create_app(
    config: ServerConfig,
    engine_factory: Callable[[], LLMEngine] | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """``engine_factory`` builds the engine (off the event loop); ``on_fatal`` is told when loading
    or the engine loop fails, so the process can exit non-zero."""
    state = AppState.create(config, on_fatal)
    if config.trust_remote_code:
        logger.warning(
            "--trust-remote-code is on: Python code shipped with %s will run in this process; "
            "use it only with models whose code you trust", config.target_path,
        )
    lifespan = Lifespan(state, engine_factory or (lambda: LLMEngine(config.engine_config())))
    # No /docs, /redoc or /openapi.json: they would be open routes beside the API key (and the UIs load from a CDN).
    app = FastAPI(title="specd", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specd = state
    errors.install(app)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    if config.cors_origins:  # added last, so outermost: even a 413 or 401 carries the CORS headers
        app.add_middleware(
            CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
        )
    routes.include(app)
    return app


@dataclass(frozen=True)
class Lifespan:
    """Start-up loads the engine on a thread and starts serving once it is in; shutdown drains."""

    state: AppState
    factory: Callable[[], LLMEngine]

    @contextlib.asynccontextmanager
    async def __call__(self, _: FastAPI) -> AsyncIterator[None]:
        state = self.state
        loop = asyncio.get_running_loop()
        # A daemon thread, not the default executor: a shutdown during a long load must not wait for it.
        threading.Thread(target=self._load, args=(loop,), name="specd-load", daemon=True).start()
        stats_task = asyncio.create_task(state.stats_log.run()) if state.stats_log is not None else None
        yield
        state.draining = True
        if state.serving is not None:
            await state.serving.async_engine.shutdown(state.config.shutdown_timeout)
        if stats_task is not None:
            stats_task.cancel()

    def _load(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loading thread; what it finds is handed to the event loop."""
        config = self.state.config
        try:
            engine = self.factory()
            template = Path(config.chat_template).read_text() if config.chat_template else None
        except BaseException as exc:  # reported to the loop, which exits the process
            logger.exception("loading the model failed")
            _post(loop, self.state.fail, exc)
            return
        _post(loop, self._ready, engine, template)

    def _ready(self, engine: LLMEngine, template: str | None) -> None:
        state, config = self.state, self.state.config
        if state.draining:  # shut down while loading: nothing to serve
            return
        state.metrics.declare_methods(draft_methods(engine))
        declare_compile(state.metrics.registry, state.metrics.model_name, lambda: engine.compile_state,
                        lambda: engine.forward_counts)
        if "suffix" in draft_methods(engine):
            state.metrics.declare_suffix_cache(engine.drafting.suffix_cache_nodes)  # type: ignore[union-attr]
        if engine.controller is not None:
            state.metrics.controller.declare_cost_model(engine.controller.cost.parameters)
        observers = [state.metrics] if state.stats_log is None else [state.metrics, state.stats_log]
        async_engine = AsyncEngine(engine, config.max_queue, observers=observers, on_fatal=state.fail)
        limits = Limits(config.max_n, config.max_stop_sequences, config.request_timeout, config.token_healing,
                        config.max_logprobs)
        state.serving = Serving(
            engine, async_engine, config.served_name, TokenText(engine.tokenizer), template, state.tracking, limits
        )
        async_engine.start()
        logger.info("ready: serving %s", config.served_name)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the server stopped while the model was loading
        logger.info("the server stopped before the model finished loading")

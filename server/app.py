"""The FastAPI app: routes, API-key check, start-up (load the engine in the background) and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware

from engine import LLMEngine
from server import errors
from server.async_engine import AsyncEngine
from server.chat import create_chat_completion
from server.completions import create_completion
from server.config import ServerConfig
from server.errors import APIError, from_exception, unavailable
from server.logprobs import TokenText
from server.metrics import CONTENT_TYPE, Metrics, draft_methods
from server.middleware import BodySizeLimit
from server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from server.request_stats import RequestTracking
from server.serving import ClientGoneError, Limits, Serving
from server.stats_log import StatsLog

logger = logging.getLogger(__name__)


@dataclass
class AppState:
    """The server's lifecycle: loading -> ready -> draining (or failed). Touched only on the event loop,
    except ``begin_drain`` which a signal handler may call (it only sets flags)."""

    config: ServerConfig
    metrics: Metrics
    stats_log: StatsLog | None = None  # None: --log-stats-interval 0
    serving: Serving | None = None
    draining: bool = False
    failure: BaseException | None = None

    @property
    def status(self) -> str:
        if self.failure is not None:
            return "failed"
        if self.draining:
            return "shutting_down"
        return "ready" if self.serving is not None else "loading"

    def begin_drain(self) -> None:
        self.draining = True
        if self.serving is not None:
            self.serving.async_engine.stop_accepting()


def create_app(
    config: ServerConfig,
    engine_factory: Callable[[], LLMEngine] | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """``engine_factory`` builds the engine (off the event loop); ``on_fatal`` is told when loading
    or the engine loop fails, so the process can exit non-zero."""
    factory = engine_factory or (lambda: LLMEngine(config.engine_config()))
    state = AppState(config, Metrics(config.served_name))
    if config.log_stats_interval > 0:
        state.stats_log = StatsLog(config.log_stats_interval)
    tracking = RequestTracking(
        state.metrics, log_requests=config.log_requests or config.log_request_text, log_text=config.log_request_text
    )
    limits = Limits(config.max_n, config.max_stop_sequences, config.request_timeout, config.token_healing)
    if config.trust_remote_code:
        logger.warning(
            "--trust-remote-code is on: Python code shipped with %s will run in this process; "
            "use it only with models whose code you trust", config.target_path,
        )

    def fail(exc: BaseException) -> None:
        state.failure = exc
        if on_fatal is not None:
            on_fatal(exc)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()

        def load() -> None:
            try:
                engine = factory()
                template = Path(config.chat_template).read_text() if config.chat_template else None
            except BaseException as exc:  # reported to the loop, which exits the process
                logger.exception("loading the model failed")
                _post(loop, fail, exc)
                return
            _post(loop, ready, engine, template)

        def ready(engine: LLMEngine, template: str | None) -> None:
            if state.draining:  # shut down while loading: nothing to serve
                return
            state.metrics.declare_methods(draft_methods(engine))
            state.metrics.declare_compile(lambda: engine.compile_state)
            observers = [state.metrics] if state.stats_log is None else [state.metrics, state.stats_log]
            async_engine = AsyncEngine(engine, config.max_queue, observers=observers, on_fatal=fail)
            state.serving = Serving(
                engine, async_engine, config.served_name, TokenText(engine.tokenizer), template, tracking, limits
            )
            async_engine.start()
            logger.info("ready: serving %s", config.served_name)

        # A daemon thread, not the default executor: a shutdown during a long load must not wait for it.
        threading.Thread(target=load, name="specd-load", daemon=True).start()
        stats_task = asyncio.create_task(state.stats_log.run()) if state.stats_log is not None else None
        yield
        state.draining = True
        if state.serving is not None:
            await state.serving.async_engine.shutdown(config.shutdown_timeout)
        if stats_task is not None:
            stats_task.cancel()

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

    def serving() -> Serving:
        if state.failure is not None:
            raise unavailable("the engine has failed; the server is exiting")
        if state.draining:
            raise unavailable("the server is shutting down")
        if state.serving is None:
            raise unavailable("the model is still loading")
        return state.serving

    def check_key(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _guard(create_completion(body, request, serving()))

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _guard(create_chat_completion(body, request, serving()))

    def card() -> ModelCard:
        s = serving()
        ec = s.engine.config  # what the engine runs, whichever way it was built
        return ModelCard(
            id=config.served_name, root=config.target_path, max_model_len=s.max_model_len,
            draft_model=ec.draft_model if ec.uses_draft_model else None, speculative_method=ec.speculative_method.value,
        )

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @v1.get("/models/{model:path}")
    async def model(model: str) -> ModelCard:
        serving().check_model(model)
        return card()

    app.include_router(v1)

    @app.get("/health")
    async def health() -> JSONResponse:
        status = state.status
        body = {"status": status}
        if status == "ready" and state.serving is not None:
            # "compiling": serving already, its decode forwards still eager until then (--compile background)
            body["compile"] = state.serving.engine.compile_state
        return JSONResponse(body, status_code=200 if status == "ready" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _guard(work: Awaitable[Response]) -> Response:
    """Map whatever a handler raises to an OpenAI error; unexpected errors are logged, never echoed."""
    try:
        return await work
    except ClientGoneError:
        return Response(status_code=499)  # nobody is listening; nginx's code for it
    except Exception as exc:
        raise from_exception(exc) from None


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the server stopped while the model was loading
        logger.info("the server stopped before the model finished loading")

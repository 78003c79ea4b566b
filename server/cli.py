"""``specd serve``: parse flags (over an optional YAML config), load the model, serve until SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

from server.config import CONFIG_ENV, ENV_PREFIX, ConfigError, ServerConfig
from server.options_cli import add_option_flags
from server.options_sources import CONFIG_HELP, DEVICE_MEMORY_HELP, DRY_RUN_HELP, gather

logger = logging.getLogger("server")
# Flags that say how to start, not what to serve: not options, so no YAML key or variable reads them.
START_FLAGS = ("dry_run", "device_memory")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="OpenAI-compatible server with speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve", help="serve a model over HTTP", argument_default=argparse.SUPPRESS,
        description=f"Every option is also read from {ENV_PREFIX}<OPTION> (e.g. {ENV_PREFIX}MAX_NUM_SEQS=8, "
        f"{ENV_PREFIX}LOG_REQUESTS=true) and --config from {CONFIG_ENV}. Flags win over the config file, which wins "
        "over the environment.",
    )
    s.add_argument("--config", metavar="FILE", default=None, help=f"{CONFIG_HELP} (or set {CONFIG_ENV})")
    add_option_flags(s, ServerConfig)
    s.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    s.add_argument("--device-memory", metavar="SIZE", help=DEVICE_MEMORY_HELP)
    distill = sub.add_parser(
        "distill", help="train a draft for a target on a text corpus: a small draft model by distillation (KL to "
        "the target), with --method eagle an EAGLE-3 head on the target's hidden states, or with --method self an "
        "exit head for the target's early layers"
    )
    from recipe.distill_cli import add_arguments

    add_arguments(distill)
    return parser


def parse_config(argv: list[str] | None = None) -> ServerConfig:
    """Flags over the YAML file over the environment over the defaults. Raises ConfigError."""
    args = vars(build_parser().parse_args(argv))
    args.pop("command")
    for flag in START_FLAGS:  # main reads them
        args.pop(flag, None)
    yaml_path = args.pop("config")
    sourced = gather(ServerConfig, yaml_path, args, os.environ)
    config = sourced.build(ServerConfig)
    config.check_models_exist()
    try:
        config.engine_config()  # the engine's own checks (k range, device map, ...), before anything loads
    except ValueError as exc:
        raise sourced.blame(exc) from None
    return config


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["distill"]:
        from recipe.distill_cli import run

        return run(build_parser().parse_args(args))
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        print(f"specd: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    flags = vars(build_parser().parse_args(argv))
    if flags.get("device_memory") is not None and not flags.get("dry_run"):
        print("specd: error: --device-memory plans for another device: it goes with --dry-run", file=sys.stderr)
        return 2
    if flags.get("dry_run"):
        return dry_run(config, flags.get("device_memory"))
    if int(os.environ.get("RANK", "0")) > 0:
        # Under torchrun every rank runs this command: the ones above 0 follow rank 0, which serves.
        from engine import follow_rank

        return follow_rank(config.device)
    return serve(config)


def dry_run(config: ServerConfig, device_memory: str | None) -> int:
    """Prints the plan a start would make (exit 0), or the error it would stop with (exit 2)."""
    from engine import dry_run as plan_start
    from engine import parse_size

    try:
        memory = parse_size(device_memory) if device_memory is not None else None
        result = plan_start(config.engine_config(), memory)
    except (ValueError, OSError) as exc:
        print(f"specd: error: {exc}", file=sys.stderr)
        return 2
    plan = result.plan
    print(f"dry run: {config.model} ({result.target_params / 1e9:.2f}B parameters)"
          + (f" with {config.draft_model} ({result.draft_params / 1e9:.2f}B)" if result.draft_params else "")
          + f", {str(result.dtype).removeprefix('torch.')} on {result.device}")
    for warning in plan.warnings:
        print(f"warning: {warning}")
    print(plan.describe())
    return 0


def serve(config: ServerConfig) -> int:
    from server.app import create_app  # torch and transformers: only once the flags are known to be good

    servers: list[_Server] = []

    def on_fatal(exc: BaseException) -> None:
        logger.error("fatal: %s; shutting down", exc)
        for server in servers:
            server.should_exit = True

    from engine import LLMEngine

    # This process serves one engine for its life: what exists once it is built is frozen (engine.core.heap).
    def factory() -> LLMEngine:
        return LLMEngine(dataclasses.replace(config.engine_config(), freeze_heap=True))

    app = create_app(config, engine_factory=factory, on_fatal=on_fatal)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=config.shutdown_timeout,  # type: ignore[arg-type] - a float works
    )
    server = _Server(uv_config, on_signal=app.state.specd.begin_drain)
    servers.append(server)
    server.run()
    if app.state.specd.failure is not None:
        return 1
    return 0 if server.started else 1


class _Server(uvicorn.Server):
    """uvicorn's server, with two changes: a signal first marks the app as draining (so /health
    and new requests answer 503 at once), and a graceful shutdown exits 0 instead of re-raising the
    signal (uvicorn's default makes a clean SIGTERM exit look like a kill)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_signal()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

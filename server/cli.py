"""``specd serve``: parse flags (over an optional YAML config), load the model, serve until SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

from server.config import (
    API_KEY_ENV,
    COMPILE_MODES,
    CONFIG_ENV,
    ENV_PREFIX,
    METHODS,
    ConfigError,
    ServerConfig,
    load_config,
)

logger = logging.getLogger("server")


def _k(value: str) -> int | None:
    if value in ("adaptive", "auto"):
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'adaptive', got {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="OpenAI-compatible server with speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve", help="serve a model over HTTP", argument_default=argparse.SUPPRESS,
        description=f"Every option is also read from {ENV_PREFIX}<OPTION> (e.g. {ENV_PREFIX}MAX_NUM_SEQS=8, "
        f"{ENV_PREFIX}LOG_REQUESTS=true) and --config from {CONFIG_ENV}. Flags win over the config file, which wins "
        "over the environment.",
    )
    d = ServerConfig()  # the defaults, for the help text only: absent flags must not override the YAML
    s.add_argument(
        "--config", default=None, help=f"YAML file with the same options, dashes or underscores (or set {CONFIG_ENV})"
    )
    s.add_argument("--model", help="target model directory or hub id (default: the embedded pair in models/default)")
    s.add_argument("--draft-model",
                   help="draft model sharing the target's tokenizer, or an EAGLE-3 head for the target")
    s.add_argument("--draft-layers", type=int, metavar="L",
                   help="self-speculation: the target's first L layers, its final norm and LM head draft, over "
                   "the target's own KV cache (method self; with hybrid, beside lookup and any draft model)")
    s.add_argument("--speculative-method", choices=METHODS,
                   help="default: hybrid (draft model + n-gram lookup) with a draft, else none; self: the target's "
                   "first --draft-layers layers draft (default a third of them); eagle: --draft-model is an EAGLE-3 "
                   "head reading the target's hidden states (the embedded target has one)")
    s.add_argument("--num-speculative-tokens", type=_k, help="drafts per step, 0..16, or 'adaptive' (default)")
    s.add_argument("--served-model-name", help="the model id clients use (default: the model directory's name)")
    s.add_argument("--chat-template", help="Jinja file to use instead of the tokenizer's chat template")
    s.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), help=f"default {d.dtype}")
    s.add_argument("--device", help=f"auto, cpu, cuda or cuda:N (default {d.device}); with --device-map, the draft's")
    s.add_argument(
        "--device-map",
        help="split the target across GPUs with accelerate: auto, balanced, balanced_low_0, sequential, or a JSON "
        'object of module -> device such as \'{"model.embed_tokens": 0, "model.layers.0": 0, ..., "lm_head": 1}\'',
    )
    s.add_argument("--max-model-len", type=int, help="context length (default: the model's own)")
    s.add_argument("--max-num-seqs", type=int, help=f"largest running batch (default {d.max_num_seqs})")
    s.add_argument("--max-num-batched-tokens", type=int, help=f"tokens per step (default {d.max_num_batched_tokens})")
    s.add_argument("--kv-cache-memory-gb", type=float, help=f"KV cache budget (default {d.kv_cache_memory_gb})")
    s.add_argument("--max-queue", type=int, help=f"waiting requests before 429 (default {d.max_queue})")
    s.add_argument("--max-n", type=int, help=f"most choices (n) per request (default {d.max_n})")
    s.add_argument(
        "--max-stop-sequences", type=int, help=f"most stop strings per request (default {d.max_stop_sequences})"
    )
    s.add_argument("--max-body-bytes", type=int, help=f"largest request body, else 413 (default {d.max_body_bytes})")
    s.add_argument(
        "--request-timeout", type=float,
        help="seconds a request may take before it is aborted with a 504 (default: no deadline)",
    )
    s.add_argument("--host", help=f"bind address (default {d.host}; 0.0.0.0 to listen on every interface)")
    s.add_argument("--port", type=int, help=f"default {d.port}")
    s.add_argument("--api-key", help=f"require Authorization: Bearer KEY on /v1 (or set {API_KEY_ENV})")
    s.add_argument(
        "--cors-allow-origins",
        help="comma-separated origins (or '*') that browsers may call the API from (default: no CORS headers)",
    )
    s.add_argument("--shutdown-timeout", type=float, help=f"seconds to drain on SIGTERM (default {d.shutdown_timeout})")
    s.add_argument("--seed", type=int, help=f"engine seed for unseeded sampling (default {d.seed})")
    s.add_argument(
        "--audit-fraction", type=float,
        help="fraction of finished greedy requests re-run without speculation, at the lowest priority, and "
        f"compared (specd:spec_decode_audit_total; default {d.audit_fraction})",
    )
    s.add_argument(
        "--compile", nargs="?", const="start", choices=COMPILE_MODES, metavar="{auto,off,start,background}",
        help="torch.compile the target's and the draft's decode and verify forwards, with progress in the log: "
        "start = before serving (--compile alone), background = serve eagerly at once and switch to the compiled "
        "forwards when they are ready, auto = background on CPU in float32 where a C++ compiler is found, else "
        f"off (default {d.compile}; the first compile on a machine takes minutes, later ones read inductor's cache)",
    )
    s.add_argument(
        "--cuda-graphs", action=argparse.BooleanOptionalAction,
        help="pad decode and verify forwards to static bucket shapes and replay them as CUDA graphs, captured at "
        "start-up with progress in the log (default: on when the target runs on one GPU, off on CPU and for "
        "--device-map; output is the same either way)",
    )
    s.add_argument(
        "--paged-attention", choices=("auto", "flex", "gather"),
        help="how bucketed decode and verify forwards read the KV cache: flex = FlexAttention through the block "
        "table, in place; gather = each sequence's keys copied into a padded tensor per layer, then SDPA "
        "(default auto: flex on CUDA, gather on CPU, where it measured faster)",
    )
    s.add_argument(
        "--no-prefix-caching", action="store_false", dest="prefix_caching",
        help="compute every prompt in full instead of reusing the KV blocks of a prefix an earlier request "
        "computed (on by default; output is the same either way)",
    )
    s.add_argument(
        "--no-grammar-drafts", action="store_false", dest="grammar_drafts",
        help="with speculation on, do not draft the tokens a structured request's grammar forces (keys, "
        "punctuation, closing brackets); they are drafted for free by default and output is the same either way",
    )
    s.add_argument(
        "--token-healing", action="store_true",
        help="heal the prompt's last token by default: it is backed off and the model re-spells it, so a prompt "
        "that ends at a line end continues the way the tokenizer would have merged it (requests decide with "
        "token_healing; never applied by default to structured output)",
    )
    s.add_argument(
        "--trust-remote-code", action="store_true",
        help="run Python code shipped with the model directory (off by default; a warning is logged when on)",
    )
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help=f"default {d.log_level}")
    s.add_argument(
        "--log-stats-interval", type=float,
        help=f"seconds between stats log lines while busy, 0 for none (default {d.log_stats_interval:g})",
    )
    s.add_argument("--log-requests", action="store_true", help="log one line per request: ids, lengths, timings")
    s.add_argument(
        "--log-request-text", action="store_true", help="also log prompts and completions (implies --log-requests)"
    )
    distill = sub.add_parser(
        "distill", help="train a draft for a target on a text corpus: a small draft model by distillation (KL to "
        "the target), with --method eagle an EAGLE-3 head on the target's hidden states, or with --method self an "
        "exit head for the target's early layers"
    )
    from recipe.distill_cli import add_arguments

    add_arguments(distill)
    return parser


def parse_config(argv: list[str] | None = None) -> ServerConfig:
    """Flags over the YAML file over the defaults. Raises ConfigError."""
    args = vars(build_parser().parse_args(argv))
    args.pop("command")
    yaml_path = args.pop("config")
    config = load_config(yaml_path, args)
    config.check_models_exist()
    try:
        config.engine_config()  # the engine's own checks (dtype, k range, ...), before anything loads
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
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
    return serve(config)


def serve(config: ServerConfig) -> int:
    from server.app import create_app  # torch and transformers: only once the flags are known to be good

    servers: list[_Server] = []

    def on_fatal(exc: BaseException) -> None:
        logger.error("fatal: %s; shutting down", exc)
        for server in servers:
            server.should_exit = True

    app = create_app(config, on_fatal=on_fatal)
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

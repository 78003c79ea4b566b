"""Server configuration: one frozen dataclass whose fields are the options, filled from defaults < SPECD_*
environment variables < YAML file < command-line flags (server.options_sources)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server import options_sources
from server.options import ENV_PREFIX, ConfigError, option, specs
from server.options_sources import CONFIG_ENV

if TYPE_CHECKING:
    from engine import EngineConfig

__all__ = ["CONFIG_ENV", "ENV_PREFIX", "ConfigError", "ServerConfig", "load_config", "read_env", "read_yaml"]

REPO_ROOT = Path(__file__).resolve().parents[1]
# A non-editable install (the Docker image) has no repository around the package: the image says where the pair is.
DEFAULT_PAIR_ENV = "SPECD_DEFAULT_PAIR_DIR"
DEFAULT_PAIR = Path(os.environ.get(DEFAULT_PAIR_ENV) or REPO_ROOT / "models" / "default")
DEFAULT_TARGET = DEFAULT_PAIR / "target"
DEFAULT_DRAFT = DEFAULT_PAIR / "draft"
DEFAULT_EAGLE = DEFAULT_PAIR / "eagle"  # the EAGLE-3 head trained for the embedded target (recipe.eagle)
DEFAULT_SERVED_NAME = "specd-default"
COMPILE_MODES = ("auto", "off", "start", "background")  # engine.CompileMode's values
METHODS = ("hybrid", "draft_model", "eagle", "ngram", "suffix", "self", "none")
LOG_LEVELS = ("debug", "info", "warning", "error")


# YAML's own forms of three options, turned into what the flag would have given.
def _json_text(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, dict) else value  # a device_map mapping: the flag's JSON text


def _comma_text(value: Any) -> Any:
    return ",".join(str(v) for v in value) if isinstance(value, list) else value  # CORS origins as a list


def _compile_mode(value: Any) -> Any:
    # YAML reads a bare off, on, true or false as a boolean.
    return ("start" if value else "off") if isinstance(value, bool) else value


@dataclass(frozen=True)
class ServerConfig:
    """Every option of ``specd serve``, declared once: its type, default and help here; its flag, variable, YAML key
    and docs row derived (server.options). ``engine=True``: passed on to EngineConfig under the same name."""

    model: str | None = option(None, "target model: a directory or a hub id", engine=True,
                               shown_default="the embedded pair")
    draft_model: str | None = option(
        None, "a draft model sharing the target's tokenizer, or an EAGLE-3 head for the target", engine=True,
        shown_default="the embedded draft without `--model`, else none",
    )
    draft_layers: int | None = option(
        None, "self-speculation: the target's first L layers, its final norm and LM head draft over the target's own "
        "KV cache (method `self`, or a source of `hybrid`)", metavar="L", engine=True,
        shown_default="the exit head's depth, else a third of the layers",
    )
    speculative_method: str | None = option(
        None, "`hybrid` (a draft model, n-gram lookup and suffix decoding), `draft_model`, `eagle` (`--draft-model` is "
        "an EAGLE-3 head), `ngram`, `suffix` (suffix tries over the request and recent outputs), `self` (the target's "
        "first `--draft-layers` layers) or `none`", choices=METHODS, engine=True,
        shown_default="`hybrid` with a draft or `--draft-layers`, else `none`",
    )
    num_speculative_tokens: int | None = option(
        None, "drafts per step, 0..16, or `adaptive`: chosen per sequence per step", none_words=("adaptive", "auto"),
        metavar="K", engine=True, shown_default="`adaptive`")
    max_speculative_tokens: int = option(
        8, "with adaptive k: the most drafts a model drafter gives a sequence in a step, 1..16 (the shipped graphs "
        "are for 8: another K compiles its own)", metavar="K", engine=True)
    max_lookup_tokens: int = option(
        24, "with adaptive k: the most drafts prompt lookup or suffix decoding gives a sequence in a step, 1..31 (at "
        "least `--max-speculative-tokens`; no forward drafts them)", metavar="K", engine=True)
    suffix_cache_requests: int = option(
        1000, "suffix decoding: keep the outputs of this many recently ended requests to draft from", metavar="N",
        engine=True)
    suffix_max_draft: int = option(24, "suffix decoding: the longest draft", metavar="K", engine=True)
    draft_confidence: float = option(
        0.0, "a model drafter (draft model, EAGLE head, early exit) stops a sequence's drafts after one it gave less "
        "than this probability, in [0, 1); 0: never early", metavar="P", engine=True)
    served_model_name: str | None = option(
        None, "the model id clients send",
        shown_default="`specd-default` for the embedded pair, else the model directory's name")
    chat_template: str | None = option(
        None, "a Jinja file used instead of the tokenizer's chat template", metavar="FILE")
    dtype: str = option(
        "auto", "`auto` (bfloat16 on a GPU, float32 on CPU), `float32`, `bfloat16` or `float16`",
        choices=("auto", "float32", "bfloat16", "float16"), engine=True,
    )
    device: str = option("auto", "`auto`, `cpu`, `cuda` or `cuda:N`; with `--device-map`, the draft's", engine=True)
    # Checked by EngineConfig (importing the engine here would load torch).
    device_map: str | None = option(
        None, "split the target across GPUs with accelerate: `auto`, `balanced`, `balanced_low_0`, `sequential` or "
        "a JSON object of module -> device (in YAML, a mapping)", engine=True, from_yaml=_json_text,
    )
    tensor_parallel_size: int = option(
        1, "shard the target over this many ranks, one process each (GPUs with NCCL, CPU processes with gloo); "
        "specd starts the other ranks itself, or runs under `torchrun --nproc-per-node N`", engine=True,
    )
    max_model_len: int | None = option(None, "context length", engine=True, shown_default="the model's")
    max_num_seqs: int = option(64, "largest running batch", engine=True)
    max_num_batched_tokens: int = option(
        2048, "tokens per step (prompt chunks, drafts and catch-up included)", engine=True)
    prefill_hold_steps: int = option(
        4, "steps a prompt arriving while the batch decodes may wait for others, to be prefilled with them; it "
        "waits only while another is due by the recent arrival rate (0: never)", engine=True,
    )
    prefill_group_tokens: int = option(512, "waiting prompts of this many tokens in all join at once", engine=True)
    memory_utilization: float | None = option(
        None, "share of the device specd may use in all (weights, activations, KV cache); on CPU, share of the RAM "
        "available besides the weights that the KV cache may take", engine=True,
        shown_default="0.9 on CUDA, 0.25 on CPU",
    )
    kv_cache_memory_gb: float | None = option(
        None, "KV cache budget in GiB, the target's and the draft's together, instead of the memory plan's",
        engine=True, shown_default="what --memory-utilization leaves (1 with --device-map)",
    )
    max_queue: int = option(512, "requests waiting for a batch slot before new ones get 429")
    max_n: int = option(128, "most choices (`n`) one request may ask for (OpenAI's limit)")
    max_stop_sequences: int = option(4, "most stop strings one request may give (OpenAI's limit)")
    max_logprobs: int = option(20, "most alternatives `logprobs`, `top_logprobs` or `prompt_logprobs` may ask for "
                               "(at most 20)")
    max_body_bytes: int = option(
        8 * 2**20, "largest request body in bytes; larger ones get 413", shown_default="8388608 (8 MiB)"
    )
    request_timeout: float | None = option(
        None, "seconds before an unfinished request is aborted with a 504", shown_default="none: no deadline")
    host: str = option("127.0.0.1", "bind address; `0.0.0.0` to listen on every interface")
    port: int = option(8000, "TCP port to listen on")
    api_key: str | None = option(None, "require `Authorization: Bearer KEY` on `/v1/*`", metavar="KEY")
    cors_allow_origins: str | None = option(
        None, "comma-separated origins (or `*`) browsers may call the API from (in YAML, a list)",
        shown_default="none: no CORS headers", from_yaml=_comma_text,
    )
    shutdown_timeout: float = option(30.0, "seconds in-flight requests get to finish on SIGTERM or SIGINT")
    seed: int = option(0, "engine seed for unseeded sampling", engine=True)
    trust_remote_code: bool = option(False, "run Python code shipped with the model directory (a warning is logged)",
                                     engine=True)
    audit_fraction: float = option(
        0.0, "share of finished greedy requests re-run without speculation, at the lowest priority, and compared "
        "(`specd:spec_decode_audit_total`)", engine=True)
    compile: str = option(
        "auto", "`torch.compile` the target's and the draft's decode and verify forwards: `start` before serving (the "
        "flag alone), `background` serving eagerly until a child process at the lowest CPU priority has compiled "
        "them (on CPU, where `start` waits for the same child, and its prompt graphs too; later starts load them), "
        "`off`, or `auto`: `background` on CPU in float32 where a C++ compiler is found, else `off` (in YAML, true "
        "and false are `start` and `off`); a machine's first compile takes minutes, later ones read inductor's cache",
        choices=COMPILE_MODES, bare="start", metavar="MODE", engine=True, from_yaml=_compile_mode)
    compile_prompts: bool = option(
        True, "with `--compile background`: the prompt graphs too, compiled once the decode graphs serve where none "
        "are on disk (prompt chunks run eagerly until then)", engine=True)
    prefix_caching: bool = option(
        True, "reuse the KV blocks of a prompt prefix an earlier request computed (output is the same either way)",
        engine=True)
    grammar_drafts: bool = option(
        True, "with speculation on, draft the tokens a structured request's grammar forces (keys, punctuation, "
        "closing brackets), for free", engine=True,
    )
    token_healing: bool = option(
        False, "heal the prompt's last token unless a request says `token_healing: false` (never by default for "
        "structured output)",
    )
    cuda_graphs: bool | None = option(
        None, "pad decode and verify forwards to static shapes and replay them as CUDA graphs, captured at start-up "
        "(output is the same either way)", engine=True,
        shown_default="on when the target runs on one GPU, else off",
    )
    paged_attention: str = option(
        "auto", "how bucketed decode and verify forwards read the KV cache: `flex` (FlexAttention through the block "
        "table, in place; on CUDA, blocks of 16 tokens or more), `gather` (a padded copy per layer, then SDPA) or "
        "`auto`", choices=("auto", "flex", "gather"), engine=True,
        shown_default="`auto`: `flex` on CUDA with `--block-size` >= 16, else `gather`",
    )
    log_level: str = option("info", "`debug`, `info`, `warning` or `error`", choices=LOG_LEVELS)
    log_stats_interval: float = option(10.0, "seconds between stats log lines while busy; 0 for none")
    log_requests: bool = option(False, "log one line per finished request: ids, token counts, timings (never text)")
    log_request_text: bool = option(False, "also log the prompt and completion text (implies `--log-requests`)")

    def __post_init__(self) -> None:
        for spec in specs(ServerConfig):  # types and choices, as declared
            problem = spec.problem(getattr(self, spec.name))
            if problem is not None:
                raise ConfigError(problem)
        if self.speculative_method in ("draft_model", "eagle") and self.model is not None and not self.draft_model:
            raise ConfigError(f"speculative_method {self.speculative_method} needs --draft-model")
        if (self.speculative_method == "hybrid" and self.model is not None and not self.draft_model
                and self.draft_layers is None):
            raise ConfigError("speculative_method hybrid needs --draft-model or --draft-layers (or both)")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ConfigError(f"draft_layers must be >= 1, got {self.draft_layers}")
        if self.draft_layers is not None and self.method not in ("self", "hybrid"):
            raise ConfigError(f"draft_layers is for speculative_method self or hybrid, not {self.method}")
        if self.max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {self.max_queue}")
        if not 0 <= self.max_logprobs <= 20:
            raise ConfigError(f"max_logprobs must be in [0, 20], got {self.max_logprobs}")
        for name in ("max_n", "max_stop_sequences", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ConfigError(f"request_timeout must be > 0 seconds (unset for none), got {self.request_timeout}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.shutdown_timeout < 0:
            raise ConfigError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.log_stats_interval < 0:
            raise ConfigError(f"log_stats_interval must be >= 0 (0 turns it off), got {self.log_stats_interval}")

    @property
    def cors_origins(self) -> list[str]:
        return [o.strip() for o in (self.cors_allow_origins or "").split(",") if o.strip()]

    @property
    def uses_default_pair(self) -> bool:
        return self.model is None

    @property
    def target_path(self) -> str:
        return self.model if self.model is not None else str(DEFAULT_TARGET)

    @property
    def draft_path(self) -> str | None:
        if self.model is None and self.speculative_method == "eagle":
            return self.draft_model or str(DEFAULT_EAGLE)
        if self.model is None and (self.draft_model or self.speculative_method in (None, "draft_model", "hybrid")):
            # The embedded pair's draft, unless self-speculation alone was asked for.
            return self.draft_model or str(DEFAULT_DRAFT)
        return self.draft_model

    @property
    def method(self) -> str:
        if self.speculative_method is not None:
            return self.speculative_method
        return "hybrid" if self.draft_path or self.draft_layers is not None else "none"

    @property
    def served_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.uses_default_pair:
            return DEFAULT_SERVED_NAME
        return Path(self.target_path.rstrip("/")).name or self.target_path

    def check_models_exist(self) -> None:
        """Fail before loading anything (and before binding a port) when a model path is missing."""
        if self.uses_default_pair:
            needed = [self.target_path]
            if self.method in ("draft_model", "eagle", "hybrid") and self.draft_path:
                needed.append(self.draft_path)
            missing = [p for p in needed if not Path(p).exists()]
            if missing:
                raise ConfigError(
                    f"no --model given, and the embedded default model pair is missing ({', '.join(missing)}). "
                    "Build it first, or serve another model: specd serve --model PATH_OR_HF_DIR "
                    "[--draft-model PATH] (or --config configs/NAME.yaml)."
                )
        for flag, path in (("--model", self.model), ("--draft-model", self.draft_model)):
            # A hub id is "org/name"; anything that looks like a local path must exist.
            if path and path.startswith(("/", ".", "~")) and not Path(path).expanduser().exists():
                raise ConfigError(f"{flag} {path} does not exist")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ConfigError(f"chat template file {self.chat_template} does not exist")

    def engine_config(self) -> EngineConfig:
        from engine import EngineConfig  # importing engine loads torch: not needed to check flags

        options = {spec.name: getattr(self, spec.name) for spec in specs(ServerConfig) if spec.option.engine}
        # The three the server resolves: the embedded pair's paths, and the method a draft implies.
        method = self.method
        options.update(
            model=self.target_path,
            draft_model=self.draft_path if method in ("draft_model", "eagle", "hybrid") else None,
            speculative_method=method,
        )
        return EngineConfig(**options)


def load_config(yaml_path: str | None = None, overrides: dict[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Defaults, then SPECD_* environment variables, then the YAML file (``yaml_path``, else $SPECD_CONFIG;
    keys with dashes or underscores), then ``overrides`` (the flags actually given on the command line)."""
    env = os.environ if environ is None else environ
    return options_sources.gather(ServerConfig, yaml_path, overrides, env).build(ServerConfig)


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The options SPECD_* variables set, converted to their types."""
    return options_sources.read_env(ServerConfig, environ)


def read_yaml(path: str) -> dict[str, Any]:
    """The options a YAML file sets."""
    return options_sources.read_yaml(ServerConfig, path)

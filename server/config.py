"""Server configuration: one frozen dataclass, filled from defaults < SPECD_* environment variables < YAML
file < command-line flags."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine import EngineConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
# A non-editable install (the Docker image) has no repository around the package: the image says where the pair is.
DEFAULT_PAIR_ENV = "SPECD_DEFAULT_PAIR_DIR"
DEFAULT_PAIR = Path(os.environ.get(DEFAULT_PAIR_ENV) or REPO_ROOT / "models" / "default")
DEFAULT_TARGET = DEFAULT_PAIR / "target"
DEFAULT_DRAFT = DEFAULT_PAIR / "draft"
DEFAULT_EAGLE = DEFAULT_PAIR / "eagle"  # the EAGLE-3 head trained for the embedded target (recipe.eagle)
DEFAULT_SERVED_NAME = "specd-default"
COMPILE_MODES = ("auto", "off", "start", "background")  # engine.CompileMode's values
ENV_PREFIX = "SPECD_"  # SPECD_<OPTION IN CAPITALS> sets any option below
API_KEY_ENV = "SPECD_API_KEY"
CONFIG_ENV = "SPECD_CONFIG"  # the YAML file, when --config is not given
METHODS = ("hybrid", "draft_model", "eagle", "ngram", "self", "none")


class ConfigError(ValueError):
    """A configuration the server cannot start with; the message says what to change."""


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = None  # None: the embedded default pair under models/default/
    draft_model: str | None = None
    draft_layers: int | None = None  # self-speculation: the target's first N layers draft (method self or hybrid)
    speculative_method: str | None = None  # None: hybrid when a draft is given, else none
    num_speculative_tokens: int | None = None  # None: adaptive k per sequence per step
    served_model_name: str | None = None  # None: the model directory's name
    chat_template: str | None = None  # a Jinja file used instead of the tokenizer's own template
    dtype: str = "auto"
    device: str = "auto"  # with device_map: the draft's device
    # The target split across GPUs by accelerate: auto, balanced, balanced_low_0, sequential, or a JSON object of
    # module name -> device. Checked by EngineConfig (importing the engine here would load torch).
    device_map: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory_gb: float = 1.0
    max_queue: int = 512  # requests waiting for a batch slot before new ones get 429
    max_n: int = 128  # choices one request may ask for (OpenAI's limit)
    max_stop_sequences: int = 4  # stop strings one request may give (OpenAI's limit)
    max_body_bytes: int = 8 * 2**20  # larger request bodies get 413
    request_timeout: float | None = None  # seconds before an unfinished request is aborted (504); None: no deadline
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    cors_allow_origins: str | None = None  # comma-separated origins (or "*") browsers may call from; None: no CORS
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    seed: int = 0
    trust_remote_code: bool = False
    audit_fraction: float = 0.0  # of finished greedy requests, re-run without speculation and compared
    # torch.compile the decode and verify forwards: auto (background on CPU in float32 with a C++ compiler, else
    # off) | off | start (compiled before serving) | background (served eagerly until compiled)
    compile: str = "auto"
    prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes earlier requests computed
    grammar_drafts: bool = True  # with speculation on, draft what a request's grammar forces (free)
    token_healing: bool = False  # the default of requests that leave token_healing unset (engine.structured.healing)
    cuda_graphs: bool | None = None  # decode and verify forwards as CUDA graphs; None: on where the model is on one GPU
    paged_attention: str = "auto"  # bucketed forwards' attention: flex (through the block table) | gather | auto
    log_level: str = "info"
    log_stats_interval: float = 10.0  # seconds between stats log lines while busy; 0 turns them off
    log_requests: bool = False  # one line per request: ids, token counts, timings (never text)
    log_request_text: bool = False  # also the prompt and completion text (implies log_requests)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        if self.speculative_method is not None and self.speculative_method not in METHODS:
            valid = ", ".join(METHODS)
            raise ConfigError(f"speculative_method must be one of {valid}, got {self.speculative_method!r}")
        if self.speculative_method in ("draft_model", "eagle") and self.model is not None and not self.draft_model:
            raise ConfigError(f"speculative_method {self.speculative_method} needs --draft-model")
        if (self.speculative_method == "hybrid" and self.model is not None and not self.draft_model
                and self.draft_layers is None):
            raise ConfigError("speculative_method hybrid needs --draft-model or --draft-layers (or both)")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ConfigError(f"draft_layers must be >= 1, got {self.draft_layers}")
        if self.draft_layers is not None and self.method not in ("self", "hybrid"):
            raise ConfigError(f"draft_layers is for speculative_method self or hybrid, not {self.method}")
        if self.compile not in COMPILE_MODES:
            raise ConfigError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {self.max_queue}")
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

        method = self.method
        return EngineConfig(
            model=self.target_path,
            draft_model=self.draft_path if method in ("draft_model", "eagle", "hybrid") else None,
            draft_layers=self.draft_layers,
            speculative_method=method,
            num_speculative_tokens=self.num_speculative_tokens,
            dtype=self.dtype,
            device=self.device,
            device_map=self.device_map,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_memory_gb=self.kv_cache_memory_gb,
            seed=self.seed,
            trust_remote_code=self.trust_remote_code,
            audit_fraction=self.audit_fraction,
            compile=self.compile,
            prefix_caching=self.prefix_caching,
            grammar_drafts=self.grammar_drafts,
            cuda_graphs=self.cuda_graphs,
            paged_attention=self.paged_attention,
        )


def _check_type(name: str, value: Any, annotation: str) -> None:
    # Annotations are strings under `from __future__ import annotations`; only these few occur.
    base = annotation.replace(" | None", "")
    if value is None:
        if "None" not in annotation:
            raise ConfigError(f"{name} must not be null")
        return
    expected: tuple[type, ...] = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}[base]
    if isinstance(value, bool) and base != "bool":
        expected = ()
    if not isinstance(value, expected):
        raise ConfigError(f"{name} must be {base}, got {value!r}")


def load_config(
    yaml_path: str | None = None, overrides: dict[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> ServerConfig:
    """Defaults, then SPECD_* environment variables, then the YAML file (``yaml_path``, else $SPECD_CONFIG;
    keys with dashes or underscores), then ``overrides`` (the flags actually given on the command line)."""
    env = os.environ if environ is None else environ
    values = read_env(env)
    yaml_path = yaml_path or env.get(CONFIG_ENV) or None
    if yaml_path is not None:
        values.update(read_yaml(yaml_path))
    values.update(overrides or {})
    try:
        return ServerConfig(**values)
    except TypeError as exc:  # a bad key would have been caught in read_yaml; keep the message anyway
        raise ConfigError(str(exc)) from None


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """SPECD_<OPTION> for each option (SPECD_MAX_NUM_SEQS=8, SPECD_LOG_REQUESTS=true, SPECD_MODEL=/models/m),
    converted to the option's type; an empty variable counts as unset."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(ServerConfig):
        var = ENV_PREFIX + f.name.upper()
        raw = environ.get(var, "").strip()
        if not raw:
            continue
        base = str(f.type).replace(" | None", "")
        if f.name == "num_speculative_tokens" and raw in ("adaptive", "auto"):
            out[f.name] = None
        elif base == "bool":
            if raw.lower() not in _TRUE + _FALSE:
                raise ConfigError(f"{var} must be one of {', '.join(_TRUE + _FALSE)}, got {raw!r}")
            out[f.name] = raw.lower() in _TRUE
        elif base in ("int", "float"):
            try:
                out[f.name] = int(raw) if base == "int" else float(raw)
            except ValueError:
                raise ConfigError(f"{var} must be {base}, got {raw!r}") from None
        else:
            out[f.name] = raw
    return out


def read_yaml(path: str) -> dict[str, Any]:
    import yaml  # only needed with --config

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option: value")
    known = {f.name for f in dataclasses.fields(ServerConfig)}
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigError(f"config file {path}: unknown option {key!r} (known: {', '.join(sorted(known))})")
        if name == "num_speculative_tokens" and value in ("adaptive", "auto"):
            value = None
        if name == "compile" and isinstance(value, bool):
            value = "start" if value else "off"  # YAML reads a bare off/on/true/false as a boolean
        if name == "device_map" and isinstance(value, dict):
            value = json.dumps(value)  # a YAML mapping, the same as the flag's JSON text
        if name == "cors_allow_origins" and isinstance(value, list):
            value = ",".join(str(v) for v in value)  # a YAML list, the same as the flag's comma-separated text
        out[name] = value
    return out

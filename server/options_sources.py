"""Where option values come from, each over the one before: the declared defaults, SPECD_* environment variables,
a YAML file, the flags given on the command line; and which of them to name when a value is refused."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from server.options import ConfigError, specs

CONFIG_ENV = "SPECD_CONFIG"  # the YAML file, when --config is not given
CONFIG_HELP = "a YAML file of these options, keys written with dashes or underscores"
DRY_RUN_HELP = ("resolve the models' configs, the tokenizers and the memory plan without loading a weight; print the "
                "plan and exit 0, or 2 with the error a start would give")
DEVICE_MEMORY_HELP = ("with --dry-run: plan for a device of this much memory (e.g. 80GiB; on CPU, the RAM available), "
                      "one this machine need not have")

T = TypeVar("T")


@dataclass(frozen=True)
class Sourced:
    """The values from every source, merged, and where each came from ("SPECD_PORT", "--port", "config file c.yaml");
    an option no source sets keeps its declared default."""

    values: dict[str, Any]
    origins: dict[str, str]

    def build(self, make: Callable[..., T]) -> T:
        try:
            return make(**self.values)
        except ValueError as exc:
            raise self.blame(exc) from None

    def blame(self, exc: ValueError) -> ConfigError:
        """``exc`` as a ConfigError that also says where its option's value came from. Every check, the server's
        and EngineConfig's, starts its message with the option's name; a message that starts otherwise is kept."""
        word = re.match(r"\w+", str(exc))
        origin = self.origins.get(word.group()) if word else None
        return ConfigError(f"{exc} (from {origin})" if origin else str(exc))


def gather(
    cls: type, yaml_path: str | None, flags: Mapping[str, Any] | None, environ: Mapping[str, str]
) -> Sourced:
    """``flags``: the options given on the command line, by name, already converted (server.options_cli)."""
    by_name = {s.name: s for s in specs(cls)}
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for name, value in read_env(cls, environ).items():
        values[name], origins[name] = value, by_name[name].env
    yaml_path = yaml_path or environ.get(CONFIG_ENV) or None
    if yaml_path is not None:
        for name, value in read_yaml(cls, yaml_path).items():
            values[name], origins[name] = value, f"config file {yaml_path}"
    for name, value in (flags or {}).items():
        values[name], origins[name] = value, by_name[name].flag_for(value)
    return Sourced(values, origins)


def read_env(cls: type, environ: Mapping[str, str]) -> dict[str, Any]:
    """SPECD_<OPTION> for each option (SPECD_MAX_NUM_SEQS=8, SPECD_LOG_REQUESTS=true, SPECD_MODEL=/models/m),
    converted to the option's type; an empty variable counts as unset, other SPECD_* names are not ours."""
    out: dict[str, Any] = {}
    for spec in specs(cls):
        raw = environ.get(spec.env, "").strip()
        if not raw:
            continue
        try:
            out[spec.name] = spec.from_text(raw)
        except ValueError as exc:
            raise ConfigError(f"{spec.env} {exc}") from None
    return out


def read_yaml(cls: type, path: str) -> dict[str, Any]:
    """A mapping of option: value, keys written with dashes or underscores."""
    import yaml  # only needed with a config file

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option: value")
    by_name = {s.name: s for s in specs(cls)}
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in by_name:
            known = ", ".join(sorted(by_name))
            raise ConfigError(f"config file {path}: unknown option {key!r} (known: {known})")
        out[name] = by_name[name].from_yaml(value)
    return out

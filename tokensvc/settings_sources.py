"""Where settings come from: defaults, a TOML file, `TOKENSVC_*` variables and explicit overrides.

Precedence, lowest first: field defaults, the config file (`--config` or `TOKENSVC_CONFIG`),
environment variables, explicit overrides (CLI flags). Every value is coerced to its field's type
and validated at start, and an error names the setting the way the operator wrote it
(`TOKENSVC_POOL_MAX_SIZE`, or the file key).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tokensvc.settings import Settings, SettingsError

__all__ = ["ENV_PREFIX", "load_settings"]

ENV_PREFIX = "TOKENSVC_"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_bool(raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
        return raw.strip().lower() in _TRUE
    raise ValueError("expected true or false")


def _parse_int(raw: object) -> int:
    if isinstance(raw, bool):
        raise ValueError("expected an integer")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str) and re.fullmatch(r"\s*-?\d+\s*", raw):
        return int(raw)
    raise ValueError("expected an integer")


def _parse_float(raw: object) -> float:
    if isinstance(raw, bool):
        raise ValueError("expected a number")
    if isinstance(raw, int | float):
        return float(raw)
    if isinstance(raw, str):
        try:
            return float(raw)
        except ValueError:
            pass
    raise ValueError("expected a number")


def _parse_str(raw: object) -> str:
    if isinstance(raw, str):
        return raw
    raise ValueError("expected a string")


def _parse_path(raw: object) -> Path:
    if isinstance(raw, Path):
        return raw
    if isinstance(raw, str) and raw.strip():
        return Path(raw).expanduser()
    raise ValueError("expected a path")


def _parse_str_tuple(raw: object) -> tuple[str, ...]:
    if isinstance(raw, str):
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if isinstance(raw, list | tuple) and all(isinstance(item, str) for item in raw):
        return tuple(raw)
    raise ValueError("expected a comma-separated list or a list of strings")


_PARSERS: dict[object, Callable[[object], Any]] = {
    bool: _parse_bool,
    int: _parse_int,
    float: _parse_float,
    str: _parse_str,
    Path: _parse_path,
    tuple[str, ...]: _parse_str_tuple,
}


def _parser_for(annotation: object) -> tuple[Callable[[object], Any], bool]:
    """The parser for a field's type and whether the field accepts None."""
    if isinstance(annotation, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return _PARSERS[members[0]], True
    return _PARSERS[annotation], False


def _coerce(source_name: str, annotation: object, raw: object) -> object:
    parser, optional = _parser_for(annotation)
    if optional and (raw is None or (isinstance(raw, str) and raw == "")):
        return None
    try:
        return parser(raw)
    except ValueError as exc:
        shown = "<empty>" if raw == "" else repr(raw)
        raise SettingsError(f"{source_name}: {exc}, got {shown}") from None


def load_settings(
    *,
    config_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Settings:
    """Build and validate Settings from a config file, the environment and overrides."""
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(Settings)
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    values: dict[str, object] = {}

    path = config_file or (Path(env[f"{ENV_PREFIX}CONFIG"]) if env.get(f"{ENV_PREFIX}CONFIG") else None)
    if path is not None:
        try:
            document = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise SettingsError(f"config file {path}: does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"config file {path}: not valid TOML ({exc})") from None
        for key, raw in document.items():
            if key not in fields:
                raise SettingsError(f"config file {path}: unknown setting {key!r}")
            values[key] = _coerce(f"{path}: {key}", hints[key], raw)

    for name in fields:
        env_name = f"{ENV_PREFIX}{name.upper()}"
        if env_name in env:
            values[name] = _coerce(env_name, hints[name], env[env_name])
    unknown = sorted(
        key
        for key in env
        if key.startswith(ENV_PREFIX)
        and key != f"{ENV_PREFIX}CONFIG"
        and key[len(ENV_PREFIX) :].lower() not in fields
        and key not in _CLIENT_ONLY_VARIABLES
    )
    if unknown:
        raise SettingsError(f"{unknown[0]}: unknown setting")

    for name, raw in (overrides or {}).items():
        if raw is not None:
            values[name] = _coerce(f"--{name.replace('_', '-')}", hints[name], raw)

    return Settings(**values).validate()  # type: ignore[arg-type]


# Variables read by client commands, not by the service.
_CLIENT_ONLY_VARIABLES = frozenset(
    f"{ENV_PREFIX}{name}" for name in ("CAPABILITY", "TARGET", "CA", "CERT", "KEY")
)

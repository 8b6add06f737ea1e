"""Typed configuration: pydantic models per component, loaded from YAML with ``key=value`` overrides.

Every component defines its own ``XxxConfig(ConfigModel)``; a run config composes them. Unknown fields
are rejected, and any validation error is re-raised as :class:`ConfigError` whose message names the
dotted path of each bad field (``trainer.lr: Input should be a valid number``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

T = TypeVar("T", bound=BaseModel)


class ConfigModel(BaseModel):
    """Base of every agentrl config: unknown fields are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ConfigError(ValueError):
    """A config file or override is invalid; the message names every bad field."""


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(
            f"  {path}: {msg} (got {e.get('input')!r})" if e["type"] != "missing" else f"  {path}: {msg}"
        )
    return "\n".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as YAML, so 3 is int, [1,2] a list)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("-")
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each dotted ``key=value`` into a nested dict (creating levels as needed)."""
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return data


def build_config(cls: type[T], data: dict[str, Any] | None = None, source: str = "config") -> T:
    """Validate a dict into ``cls``; errors name the bad fields."""
    try:
        return cls.model_validate(data or {})
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def read_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> tuple[dict[str, Any], str]:
    """The raw mapping of a YAML file (optional) with ``key=value`` overrides applied, and a description
    of its source for error messages; validate it with :func:`build_config`."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {err}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
        data = loaded
        source = str(p)
    if overrides:
        data = apply_overrides(data, overrides)
        source += " + overrides"
    return data, source


def dump_config(cfg: BaseModel) -> str:
    """YAML text of a config (what a run saves next to its outputs)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)

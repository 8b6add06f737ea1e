"""Typed configuration: pydantic models per component, loaded from YAML with ``key=value`` overrides.

Every component defines its own ``XxxConfig(ConfigModel)``; a run config composes them. Unknown fields
are rejected, and any validation error is re-raised as :class:`ConfigError` whose message names the
dotted path of each bad field (``trainer.lr: Input should be a valid number``); an unknown field is named
with the nearest fields of its section (``trainer.lrr: unknown field; did you mean 'lr'?``).
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

T = TypeVar("T", bound=BaseModel)


class ConfigModel(BaseModel):
    """Base of every agentrl config: unknown fields are errors, assignments are validated. A field that was
    replaced is listed in ``replaced_fields`` (old name -> what to write instead): setting it fails with
    that one line rather than a bare "unknown field"."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())
    replaced_fields: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _replaced(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, instead in cls.replaced_fields.items():
                if old in data:
                    raise ValueError(f"{old} was replaced: {instead}")
        return data


class ConfigError(ValueError):
    """A config file or override is invalid; the message names every bad field."""


def _section_model(cls: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The config model of the section at ``loc`` below ``cls`` (None when it is not one model: a dict,
    a list, a union of models)."""
    for part in loc:
        field = cls.model_fields.get(str(part))
        if field is None:
            return None
        annotation = field.annotation
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # X | None
            options = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = options[0] if len(options) == 1 else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        cls = annotation
    return cls


def _did_you_mean_field(cls: type[BaseModel] | None, loc: tuple[Any, ...]) -> str:
    """``"; did you mean 'lr'?"`` for an unknown field at ``loc`` close to a field of its section, else
    ``""``."""
    from agentrl.registry import did_you_mean

    section = _section_model(cls, loc[:-1]) if cls is not None and loc else None
    hint = did_you_mean(str(loc[-1]), section.model_fields) if section is not None else ""
    return f"; {hint.rstrip()}" if hint else ""


def _format_validation_error(err: ValidationError, source: str, cls: type[BaseModel] | None = None) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        # a check of several fields names them in its message; the section it was given is no help
        plain = e["type"] in ("missing", "value_error")
        line = f"  {path}: {msg}" if plain else f"  {path}: {msg} (got {e.get('input')!r})"
        if e["type"] == "extra_forbidden":
            line += _did_you_mean_field(cls, tuple(e["loc"]))
        lines.append(line)
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
        raise ConfigError(_format_validation_error(err, source, cls)) from None


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

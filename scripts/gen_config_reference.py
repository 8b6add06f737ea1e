"""Write docs/reference/config.md: every field of a run config, from the pydantic models themselves.

Walks :class:`agentrl.run_config.RunConfig` recursively (each nested config model is a section named by
its dotted path: ``rollout``, ``rollout.sampling``, ``trainer.loss``), then the fields that the Search-R1
demo's :class:`~agentrl.examples.search_r1.recipe.SearchR1Config` adds or changes. Each row gives the
field, its type, its default and its ``description``, so the reference cannot drift from the code.

    python scripts/gen_config_reference.py            # rewrite docs/reference/config.md
    python scripts/gen_config_reference.py --check    # exit 1 when the committed file is stale

``tests/test_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import enum
import inspect
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference" / "config.md"
sys.path.insert(0, str(ROOT))  # this checkout's agentrl, not another one installed in the environment
COMMAND = "python scripts/gen_config_reference.py"

HEADER = f"""# Config reference

Generated from the pydantic field descriptions by `{COMMAND}`; do not edit by hand
(`tests/test_docs.py` fails when this file is stale). How the config is loaded, overridden and
validated: [../guide/recipes-and-config.md](../guide/recipes-and-config.md).

A run config is YAML; every key below can also be set on the command line as a dotted override
(`python train_async.py rollout.group_size=4 trainer.loss.tis_cap=2`). Unknown or invalid fields fail
with their dotted path. *required* means the field has no default.
"""


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config models an annotation refers to (``X``, ``X | None``, ``list[X]``, ``dict[str, X]``)."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        for m in _models_in(arg):
            if m not in found:
                found.append(m)
    return found


def type_name(annotation: Any) -> str:
    """A short, stable spelling of a field's type: ``int | None``, ``Literal['a', 'b']``, ``list[str]``."""
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "Any"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    if inspect.isclass(annotation):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def default_text(field: FieldInfo) -> str:
    """The default as YAML would spell it; a nested model's default points at its own section. A default
    taken from the machine (the running interpreter's path) is named, not spelled, so the file is the
    same wherever it is generated."""
    if field.default is PydanticUndefined and field.default_factory is None:
        return "*required*"
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if isinstance(value, str) and value == sys.executable:
        return "the running python (sys.executable)"
    return _yaml_value(value)


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return _yaml_value(value.value)
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, str):
        return repr(value) if value else "''"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def section_rows(model: type[BaseModel], names: list[str] | None = None) -> list[str]:
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if names is not None and name not in names:
            continue
        rows.append(
            f"| `{name}` | {type_name(field.annotation)} | `{default_text(field)}` "
            f"| {_cell((field.description or '').replace('``', '`'))} |"
        )
    return rows


def walk(model: type[BaseModel], path: str, names: list[str] | None = None, prefix: str = "") -> list[str]:
    """The section of ``model`` at ``path`` followed by the sections of its nested models, depth first."""
    title = f"`{path}`" if path else "top level"
    doc = inspect.cleandoc(model.__doc__ or "").replace("``", "`")
    lines = [f"## {prefix}{title} ({model.__name__})", ""]
    if doc:
        lines += [" ".join(doc.split()), ""]
    lines += [*section_rows(model, names), ""]
    for name, field in model.model_fields.items():
        if names is not None and name not in names:
            continue
        for sub in _models_in(field.annotation):
            lines += walk(sub, f"{path}.{name}" if path else name, prefix=prefix)
    return lines


def _changed_fields(child: type[BaseModel], parent: type[BaseModel]) -> list[str]:
    """Fields ``child`` adds, or redeclares with another type, default or description."""
    out = []
    for name, field in child.model_fields.items():
        base = parent.model_fields.get(name)
        if base is None or (
            base.annotation != field.annotation
            or default_text(base) != default_text(field)
            or base.description != field.description
        ):
            out.append(name)
    return out


def render() -> str:
    from agentrl.examples.search_r1.recipe import SearchR1Config
    from agentrl.run_config import RunConfig

    lines = [HEADER, "# RunConfig", "", "The generic run config (`agentrl/run_config.py`).", ""]
    lines += walk(RunConfig, "")
    changed = _changed_fields(SearchR1Config, RunConfig)
    lines += [
        "# SearchR1Config",
        "",
        "The Search-R1 demo's config (`examples/search_r1/recipe.py`): the generic run config with these "
        "fields added or changed; every other field is as above.",
        "",
    ]
    lines += walk(SearchR1Config, "", changed, prefix="Search-R1 ")
    text = "\n".join(lines)
    return "\n".join(line.rstrip() for line in text.splitlines()).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed file differs")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.is_file() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is stale: regenerate it with `{COMMAND}`", file=sys.stderr)
            return 1
        print(f"{OUT.relative_to(ROOT)} is up to date")
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

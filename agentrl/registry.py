"""Registry: names for the pluggable parts of a run (envs, verifiers, sandbox backends).

One :class:`Registry` per kind. ``@reg.register("name")`` (or ``reg.add(name, obj)``) adds an entry;
registering a different object under a taken name is an error unless ``overwrite=True`` (re-registering
the same object is harmless, e.g. a module imported twice). ``reg.get(name)`` returns the entry, or, for
a ``"module:attr"`` name, imports it, so a config can point at user code without registering it.
Unknown names fail with the known ones listed. Built-ins register on first lookup through ``builtins``,
a callable that imports the modules that hold them. :func:`did_you_mean` gives the nearest known names of a
misspelled one (the registries' errors and the config's unknown fields use it).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
F = TypeVar("F")


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"did you mean 'search'? "`` for the known names closest to ``name`` (difflib), or ``""``."""
    close = difflib.get_close_matches(name, list(known), n=2, cutoff=0.6)
    if not close:
        return ""
    return "did you mean " + " or ".join(repr(c) for c in close) + "? "


class Registry(Generic[T]):
    """Named entries of one ``kind`` (see the module docstring)."""

    def __init__(self, kind: str, builtins: Callable[[], object] | None = None) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._builtins = builtins
        self._loaded = builtins is None

    def _load_builtins(self) -> None:
        if not self._loaded:
            self._loaded = True  # first, so a builtin module that registers does not recurse
            assert self._builtins is not None
            self._builtins()

    def add(self, name: str, entry: T, *, overwrite: bool = False) -> T:
        if not callable(entry):
            raise TypeError(f"{self.kind} {name!r}: expected a callable, got {entry!r}")
        old = self._entries.get(name)
        if old is not None and old is not entry and not overwrite:
            raise ValueError(f"{self.kind} {name!r} is already registered (by {old!r}); pass overwrite=True")
        self._entries[name] = entry
        return entry

    def register(self, name: str, *, overwrite: bool = False) -> Callable[[F], F]:
        """Decorator: ``@envs.register("search")``."""

        def deco(entry: F) -> F:
            self.add(name, entry, overwrite=overwrite)  # type: ignore[arg-type]
            return entry

        return deco

    def names(self) -> list[str]:
        self._load_builtins()
        return sorted(self._entries)

    def get(self, name: str) -> T:
        """The entry for ``name``, or the object a ``"module:attr"`` name points at."""
        self._load_builtins()
        if name in self._entries:
            return self._entries[name]
        if ":" in name:
            module, _, attr = name.partition(":")
            try:
                loaded = importlib.import_module(module)
            except ImportError as err:
                raise KeyError(f"cannot load {self.kind} {name!r}: {err}") from None
            if not hasattr(loaded, attr):
                public = [a for a in dir(loaded) if not a.startswith("_")]
                hint = did_you_mean(attr, public).rstrip()
                raise KeyError(
                    f"cannot load {self.kind} {name!r}: module {module!r} has no attribute {attr!r}"
                    + (f"; {hint}" if hint else "")
                )
            return getattr(loaded, attr)
        raise KeyError(self.unknown(name))

    def unknown(self, name: str) -> str:
        """The one line that says ``name`` is not registered: the nearest known names, then all of them."""
        known = self.names()
        return (
            f"unknown {self.kind} {name!r}; {did_you_mean(name, known)}known {self.kind}s: "
            f"{', '.join(known) or '(none)'} (or use 'module:attr')"
        )

    def __contains__(self, name: object) -> bool:
        self._load_builtins()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

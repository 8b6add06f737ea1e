"""The one registry behind envs, verifiers and sandbox backends."""

from __future__ import annotations

import pytest

from agentrl.envs.registry import ENVS
from agentrl.registry import Registry
from agentrl.rewards.base import VERIFIERS
from agentrl.sandboxes.base import SANDBOX_BACKENDS, SandboxError, make_sandbox


def test_register_get_overwrite_and_errors() -> None:
    loads = []
    reg: Registry = Registry("widget", builtins=lambda: loads.append(reg.add("builtin", len)))
    assert loads == []  # built-ins load on first lookup, once
    assert reg.names() == ["builtin"] and loads == [len]

    @reg.register("w")
    def widget() -> int:
        return 1

    reg.register("w")(widget)  # the same object again: harmless (a module imported twice)
    with pytest.raises(ValueError, match=r"widget 'w' is already registered .*pass overwrite=True"):
        reg.add("w", lambda: 2)
    reg.add("w", abs, overwrite=True)
    assert reg.get("w") is abs and "w" in reg and list(reg) == ["builtin", "w"]
    with pytest.raises(TypeError, match="expected a callable"):
        reg.add("x", 3)
    with pytest.raises(
        KeyError, match=r"unknown widget 'nope'; known widgets: builtin, w \(or use 'module:attr'\)"
    ):
        reg.get("nope")
    assert reg.get("os.path:join").__name__ == "join"  # a module:attr path needs no registration
    with pytest.raises(KeyError, match=r"cannot load widget 'os.path:nothing_here'"):
        reg.get("os.path:nothing_here")


def test_envs_verifiers_and_sandbox_backends_share_it() -> None:
    assert {"math", "search", "tool", "python"} <= set(ENVS.names())
    assert {"exact_match", "f1", "math", "code_tests"} <= set(VERIFIERS.names())
    assert {"docker", "process"} <= set(SANDBOX_BACKENDS.names())
    assert VERIFIERS.get("agentrl.rewards.builtin:exact_match_verifier") is VERIFIERS.get("exact_match")
    with pytest.raises(SandboxError, match=r"unknown sandbox backend 'nope'; known sandbox backends: docker"):
        make_sandbox("nope")
    sb = make_sandbox("agentrl.sandboxes.process:ProcessSandbox")  # a module:Class backend
    assert type(sb).__name__ == "ProcessSandbox"

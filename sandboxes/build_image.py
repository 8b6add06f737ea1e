"""Build the sandbox Docker image: ``python -m agentrl.sandboxes.build_image [--tag T] [--force]``.

Two ways, picked automatically (``--method`` forces one):

* ``docker``: ``docker build`` from the ``Dockerfile`` next to this module, when its base image is
  already present or can be pulled (``--method docker`` allows the pull).
* ``debootstrap``: offline-friendly. A minimal Debian root filesystem with ``python3`` is created with
  ``debootstrap --variant=minbase`` through the machine's configured apt mirror, hardened (setuid bits
  stripped, caches removed) and turned into an image with ``docker import``. This is the only way on
  machines that reach no container registry.

Either way the image runs as uid/gid 65534 with ``/work`` as its working directory; the sandbox mounts a
tmpfs there and keeps the root read-only. An existing tag is left alone unless ``--force``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_IMAGE = "agentrl-sandbox:latest"
BASE_IMAGE = "python:3.11-slim"
SANDBOX_UID = 65534
SUITE = "bookworm"
log = logging.getLogger("agentrl.sandboxes.build_image")

# Paths dropped from the rootfs: documentation, caches and package lists the sandbox never needs.
_PRUNE = [
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "var/cache/apt",
    "var/lib/apt/lists",
]


def image_exists(tag: str = DEFAULT_IMAGE) -> bool:
    import docker

    client = docker.from_env()
    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False
    finally:
        client.close()


def system_mirror(suite: str = SUITE, apt_dir: Path = Path("/etc/apt")) -> str | None:
    """The Debian mirror the machine's apt is configured with for ``suite`` (None: debootstrap's default).

    Reads deb822 ``*.sources`` files and one-line ``sources.list`` entries, so the build uses whatever
    mirror (or proxy/snapshot) the administrator set up instead of a host written into this code.
    """
    files = [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*"))]
    for f in files:
        if not f.is_file() or f.suffix not in (".list", ".sources", ""):
            continue
        text = f.read_text(errors="replace")
        if f.suffix == ".sources":
            for stanza in text.split("\n\n"):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if ":" in line and not line.lstrip().startswith("#"):
                        k, v = line.split(":", 1)
                        fields[k.strip().lower()] = v.strip()
                if suite in fields.get("suites", "").split() and "deb" in fields.get("types", "").split():
                    uris = fields.get("uris", "").split()
                    if uris and "security" not in uris[0]:
                        return uris[0]
        else:
            for line in text.splitlines():
                parts = line.split("#", 1)[0].split()
                # deb [opts] URI suite components...
                parts = [p for p in parts if not p.startswith("[") and not p.endswith("]")]
                if len(parts) >= 3 and parts[0] == "deb" and parts[2] == suite:
                    return parts[1]
    return None


def _run(cmd: list[str], **kw) -> None:
    log.info("$ %s", " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


def build_debootstrap(tag: str = DEFAULT_IMAGE, suite: str = SUITE, mirror: str | None = None) -> str:
    """Create the image from a debootstrap rootfs + ``docker import``. Needs root and debootstrap."""
    import docker

    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap is not installed (apt-get install debootstrap)")
    mirror = mirror or system_mirror(suite)
    with tempfile.TemporaryDirectory(prefix="agentrl-rootfs-") as tmp:
        root = Path(tmp) / "rootfs"
        cmd = ["debootstrap", "--variant=minbase", "--include=python3", suite, str(root)]
        if mirror:
            cmd.append(mirror)
        _run(cmd)
        for rel in _PRUNE:
            shutil.rmtree(root / rel, ignore_errors=True)
        # Hardening: no setuid/setgid binaries at all, so nothing inside can regain privileges.
        _run(
            ["find", str(root), "-xdev", "-perm", "/6000", "-type", "f", "-exec", "chmod", "ug-s", "{}", "+"]
        )
        (root / "work").mkdir(mode=0o1777, exist_ok=True)
        os.chmod(root / "work", 0o1777)
        tarball = Path(tmp) / "rootfs.tar"
        _run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(tarball), "."])
        repo, _, tg = tag.rpartition(":") if ":" in tag.split("/")[-1] else (tag, "", "latest")
        changes = [
            f"USER {SANDBOX_UID}:{SANDBOX_UID}",
            "WORKDIR /work",
            "ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 "
            "HOME=/work LANG=C.UTF-8 PATH=/usr/local/bin:/usr/bin:/bin",
            'CMD ["python3"]',
            "LABEL agentrl.image=sandbox",
        ]
        client = docker.from_env(timeout=600)
        try:
            client.api.import_image_from_file(str(tarball), repository=repo, tag=tg, changes=changes)
        finally:
            client.close()
    return tag


def build_dockerfile(tag: str = DEFAULT_IMAGE, base: str = BASE_IMAGE, pull: bool = True) -> str:
    """``docker build`` from the packaged Dockerfile (pulls ``base`` when ``pull`` and it is missing)."""
    import docker

    client = docker.from_env(timeout=600)
    try:
        try:
            client.images.get(base)
        except docker.errors.ImageNotFound:
            if not pull:
                raise RuntimeError(f"base image {base} is not present and pulling is disabled") from None
            client.images.pull(base)
        client.images.build(
            path=str(Path(__file__).parent),
            dockerfile="Dockerfile",
            tag=tag,
            buildargs={"BASE": base},
            rm=True,
        )
    finally:
        client.close()
    return tag


def build(tag: str = DEFAULT_IMAGE, method: str = "auto", force: bool = False) -> str:
    """Build ``tag`` unless it exists. ``method``: auto | docker | debootstrap."""
    import docker

    if not force and image_exists(tag):
        log.info("image %s exists; nothing to do (--force rebuilds)", tag)
        return tag
    if method == "docker":
        return build_dockerfile(tag, pull=True)
    if method == "debootstrap":
        return build_debootstrap(tag)
    # auto: a local base image is the cheapest; else debootstrap (no registry needed); else try a pull.
    client = docker.from_env()
    try:
        client.images.get(BASE_IMAGE)
        have_base = True
    except docker.errors.ImageNotFound:
        have_base = False
    finally:
        client.close()
    if have_base:
        return build_dockerfile(tag, pull=False)
    if shutil.which("debootstrap") and os.geteuid() == 0:
        return build_debootstrap(tag)
    return build_dockerfile(tag, pull=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m agentrl.sandboxes.build_image", description=__doc__.split("\n")[0]
    )
    p.add_argument("--tag", default=DEFAULT_IMAGE, help="image tag to build")
    p.add_argument("--method", choices=["auto", "docker", "debootstrap"], default="auto")
    p.add_argument("--force", action="store_true", help="rebuild even when the tag exists")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        tag = build(args.tag, args.method, args.force)
    except Exception as err:
        print(f"build_image: failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(f"build_image: {tag} ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Building the project's C++ host code (the host expert kernel, the copy engine's worker) into
shared libraries: compiled on first use with the system's C++ compiler, cached on disk per
(source, compiler and its version, flags, CPU model), loaded with ctypes."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


class BuildUnavailable(RuntimeError):
    """A C++ library could not be built here (no C++ compiler, or it failed)."""


def cache_dir() -> Path:
    root = os.environ.get("MOEFERRY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moeferry")
    return Path(root) / "host_kernels"


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise BuildUnavailable("no C++ compiler (g++) on PATH")
    return cxx


HEADERS = tuple(sorted(Path(__file__).parent.glob("*/*.h")))  # the headers the sources include


def build(source: Path, flags: tuple[str, ...], name: str) -> ctypes.CDLL:
    """`source` compiled with `flags` into `name`_<key>.so under `cache_dir()` (once per machine
    and version of the source and the kernels' headers; an atomic rename, so a concurrent build
    never loads half a file), loaded."""
    cxx = compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    cpu = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").exists() else ""
    cpu_model = next((line for line in cpu.splitlines() if line.startswith("model name")), "")
    texts = [source.read_text(), *(header.read_text() for header in HEADERS)]
    key = hashlib.sha256("\0".join([*texts, cxx, version, *flags, cpu_model]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run([cxx, *flags, str(source), "-o", str(built)], capture_output=True, text=True)
            if done.returncode != 0:
                raise BuildUnavailable(f"building {source.name} failed: {done.stderr.strip()[-400:]}")
            os.replace(built, target)
        logger.info("built %s: %s", source.name, target)
    return ctypes.CDLL(str(target))

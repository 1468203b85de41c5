"""The on-disk cache directory: what a second process reuses to start faster.

``$BATCHGPU_CACHE_DIR`` (default: the platform's user cache dir + ``batchgpu``; ``off`` disables it)
holds:

- ``mesa/``: the Mesa driver's shader cache (``MESA_SHADER_CACHE_DIR`` is pointed here when the user
  has not set it). wgpu-py 0.32 exposes no pipeline-cache API (wgpu-native exports no
  ``wgpuDeviceCreatePipelineCache``), so the driver's own disk cache is the persistent pipeline
  cache there is: on lavapipe it keeps the LLVM-compiled code of every dispatched pipeline.
- ``pipelines/<fingerprint>.txt``: the keys of the pipelines batchgpu built and dispatched on this
  adapter, driver and wgpu version; ``dev.stats`` counts a pipeline found there as a cache hit
  (its driver code is expected in the driver cache), else as a miss (compiled from scratch).
- ``cffi/``: wgpu-native's C header as parsed by cffi (see :mod:`batchgpu.coldstart`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("batchgpu")

ENV_CACHE_DIR = "BATCHGPU_CACHE_DIR"
OFF_VALUES = ("off", "0", "none", "false")


def user_cache_dir() -> Path:
    """The platform's per-user cache folder for batchgpu (no platformdirs dependency)."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or os.path.expanduser(r"~\AppData\Local")
        return Path(base) / "batchgpu" / "Cache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "batchgpu"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchgpu"


def cache_dir() -> Path | None:
    """``$BATCHGPU_CACHE_DIR``, or the user cache dir; None when set to ``off`` (or ``0``/``none``)."""
    value = os.environ.get(ENV_CACHE_DIR)
    if value is None or not value.strip():
        return user_cache_dir()
    if value.strip().lower() in OFF_VALUES:
        return None
    return Path(value).expanduser()


def subdir(name: str) -> Path | None:
    """``<cache dir>/<name>``, created; None when caching is off or the folder cannot be made."""
    root = cache_dir()
    if root is None:
        return None
    path = root / name
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.debug("cache dir %s unusable: %s", path, exc)
        return None
    return path


def configure_driver_cache() -> str:
    """Point Mesa's shader cache into the cache dir unless the user chose one; must run before the
    graphics instance is created. Returns where the driver cache lives (for the pipeline index)."""
    if os.environ.get("MESA_SHADER_CACHE_DISABLE", "").lower() in ("1", "true", "yes"):
        return "disabled"
    if "MESA_SHADER_CACHE_DIR" in os.environ:
        return os.environ["MESA_SHADER_CACHE_DIR"]
    mesa = subdir("mesa")
    if mesa is None:
        return "default"
    os.environ["MESA_SHADER_CACHE_DIR"] = str(mesa)
    return str(mesa)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (concurrent processes see
    either the old file or the whole new one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class PipelineIndex:
    """The pipelines built and dispatched before on one adapter/driver/wgpu version, one hex key a line.

    Lines are appended (``O_APPEND``), so concurrent processes interleave whole lines at worst."""

    def __init__(self, fingerprint: str) -> None:
        folder = subdir("pipelines")
        self.path = folder / f"{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}.txt" if folder else None
        self.known: set[str] = set()
        if self.path is not None and self.path.exists():
            try:
                self.known = set(self.path.read_text().split())
            except OSError as exc:
                log.debug("pipeline index %s unreadable: %s", self.path, exc)

    @staticmethod
    def key(*parts: object) -> str:
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]

    def __contains__(self, key: str) -> bool:
        return key in self.known

    def add(self, keys: list[str]) -> None:
        new = [k for k in dict.fromkeys(keys) if k not in self.known]
        if not new:
            return
        self.known.update(new)
        if self.path is None:
            return
        try:
            with open(self.path, "a") as handle:
                handle.write("".join(f"{k}\n" for k in new))
        except OSError as exc:
            log.debug("pipeline index %s not writable: %s", self.path, exc)


class DiskIndex:
    """Counts each pipeline a device creates as a hit (built and dispatched by an earlier process on the
    same adapter, driver and wgpu version: the driver's disk cache holds its code) or a miss (compiled
    from scratch), and adds pipelines to the index once a plan dispatches them."""

    def __init__(self, stats: Any) -> None:
        self.stats = stats
        self.index: PipelineIndex | None = None
        self._pending: dict[int, str] = {}  # id(pipeline) -> key, until first planned

    def open(self, adapter: Any, driver_cache: str) -> None:
        try:
            import wgpu.backends.wgpu_native as native

            version = native.lib_version_info
        except Exception:
            version = None
        info = sorted((str(k), str(v)) for k, v in dict(adapter.info).items())
        self.index = PipelineIndex(repr((info, version, driver_cache)))

    def created(self, pipeline: Any, key: tuple) -> None:
        digest = PipelineIndex.key(*key)
        if self.index is not None and digest in self.index:
            self.stats.pipeline_cache_hits += 1
            log.debug("pipeline cache hit %s (%s)", digest[:12], key[1])
        else:
            self.stats.pipeline_cache_misses += 1
            self._pending[id(pipeline)] = digest
            log.debug("pipeline cache miss %s (%s)", digest[:12], key[1])

    def dispatched(self, pipelines: list[Any]) -> None:
        if not self._pending:
            return
        digests = [d for d in (self._pending.pop(id(p), None) for p in pipelines) if d is not None]
        if digests and self.index is not None:
            self.index.add(digests)

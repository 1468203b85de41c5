"""Runtime compilation of CUDA C++ with NVRTC (NVIDIA) or hipRTC (AMD), bound with ctypes, with an
on-disk cache of compiled modules keyed by source, options, architecture and compiler version.

NVRTC comes from the ``nvidia-cuda-nvrtc`` wheel (``site-packages/nvidia/cu13/lib`` or, for CUDA 12
wheels, ``nvidia/cuda_nvrtc/lib``) or the system; hipRTC from ROCm (``libhiprtc.so``, or
``libamdhip64.so.5`` on ROCm 5). Set
``BATCHGPU_NVRTC`` / ``BATCHGPU_HIPRTC`` to a library path to choose one. The cache lives in
``kernels/`` of the project's cache directory (:func:`batchgpu.cache.cache_dir`: ``$BATCHGPU_CACHE_DIR``,
default the platform's user cache dir; ``off`` disables it, and every process compiles); a second
process compiling the same kernel for the same device reads it back and compiles nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import os
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from .cache import cache_dir
from .errors import CompileError, UnsupportedError

CACHE_FORMAT = 1
"""Bumped when what is stored (or how the key is made) changes."""


class ModuleCache:
    """Compiled modules on disk, one file per key under ``<root>/kernels``; written atomically (temp file +
    rename). ``root`` defaults to :func:`batchgpu.cache.cache_dir` at each use; with the cache dir
    ``off`` nothing is read or written."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root

    @property
    def path(self) -> Path | None:
        """The folder of the compiled modules; None when the cache directory is off."""
        root = self.root if self.root is not None else cache_dir()
        return None if root is None else root / "kernels"

    def get(self, key: str) -> bytes | None:
        path = self.path
        if path is None:
            return None
        try:
            return (path / key).read_bytes()
        except OSError:
            return None

    def put(self, key: str, data: bytes) -> None:
        path = self.path
        if path is None:
            return
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path, prefix=".tmp-")
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path / key)
        except OSError:
            pass  # a read-only or full cache directory costs a recompile, not an error


def _site_dirs() -> list[str]:
    dirs = [p for p in sys.path if p.endswith("site-packages") or p.endswith("dist-packages")]
    try:
        import site

        dirs += [*site.getsitepackages(), site.getusersitepackages()]
    except Exception:  # virtualenvs without site.getsitepackages
        pass
    return list(dict.fromkeys(dirs))


def _load_first(
    kind: str, env: str, wheel_globs: Sequence[str], system_names: Sequence[str], symbol: str
) -> ctypes.CDLL:
    """Load the first library found that exports ``symbol``: $env, then the pip wheels' lib folders,
    then the system."""
    tried: list[str] = []
    candidates: list[str] = []
    if os.environ.get(env):
        candidates.append(os.environ[env])
    for site_dir in _site_dirs():
        for pattern in wheel_globs:
            candidates += sorted(glob.glob(os.path.join(site_dir, pattern)), reverse=True)
    candidates += list(system_names)
    found = ctypes.util.find_library(kind)
    if found:
        candidates.append(found)
    for candidate in dict.fromkeys(candidates):
        try:
            library = ctypes.CDLL(candidate)
        except OSError as exc:
            tried.append(f"{candidate} ({exc})")
            continue
        if hasattr(library, symbol):
            return library
        tried.append(f"{candidate} (no {symbol})")
    raise UnsupportedError(f"{kind} not found; tried: {'; '.join(tried) or 'nothing'}")


class RuntimeCompiler:
    """One vendor's runtime compiler: ``compile(source, name, arch, options)`` returns module bytes
    (PTX or cubin for NVRTC, a code object for hipRTC) ready for cuModuleLoadData/hipModuleLoadData.

    NVRTC and hipRTC have the same C API under two prefixes (``nvrtcCreateProgram`` /
    ``hiprtcCreateProgram``...); :meth:`_bind` declares it once and :meth:`_compile` drives it.
    Subclasses name the prefix, the output getters, and the arguments for an architecture."""

    name: str
    lib: ctypes.CDLL
    version: tuple[int, int]
    default_target = ""
    getters: ClassVar[Mapping[str, str]] = {}  # target -> output getter ("PTX": nvrtcGetPTX, nvrtcGetPTXSize)

    def __init__(self, cache: ModuleCache | None = None) -> None:
        self.cache = cache if cache is not None else ModuleCache()
        self.compiled = 0  # compiler invocations (cache misses), for tests and stats

    def _bind(self, lib: ctypes.CDLL) -> None:
        """Declare the shared C API on ``lib`` and read the compiler's version."""
        self.lib = lib
        fn = self._fn
        fn("GetErrorString").restype = ctypes.c_char_p
        fn("GetErrorString").argtypes = [ctypes.c_int]
        fn("CreateProgram").argtypes = [
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
            ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p),
        ]  # fmt: skip
        fn("CompileProgram").argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        fn("DestroyProgram").argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        for getter in ("ProgramLog", *self.getters.values()):
            fn(f"Get{getter}Size").argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
            fn(f"Get{getter}").argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.check(fn("Version")(ctypes.byref(major), ctypes.byref(minor)), "Version")
        self.version = (major.value, minor.value)

    def _fn(self, suffix: str) -> Any:
        return getattr(self.lib, f"{self.name}{suffix}")

    def check(self, status: int, what: str) -> None:
        if status != 0:
            text = self._fn("GetErrorString")(status).decode()
            raise CompileError(f"{self.name}: {self.name}{what} failed: {text} ({status})")

    def cache_key(self, source: str, arch: str, options: Sequence[str], target: str) -> str:
        digest = hashlib.sha256()
        for part in (str(CACHE_FORMAT), self.name, "{}.{}".format(*self.version), arch, target, *options, source):
            digest.update(part.encode())
            digest.update(b"\0")
        return f"{self.name}-{arch}-{target}-{digest.hexdigest()}"

    def compile(self, source: str, name: str, arch: str, options: Sequence[str] = (), target: str = "") -> bytes:
        """Compile ``source`` for ``arch`` (``sm_90`` / ``gfx90a``), from the disk cache when present."""
        target = target or self.default_target
        if target not in self.getters:
            raise CompileError(f"{self.name}: target must be one of {sorted(self.getters)}, got {target!r}")
        key = self.cache_key(source, arch, options, target)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        binary = self._compile(source, name, arch, [*self.arch_options(arch, target), *options], target)
        self.compiled += 1
        self.cache.put(key, binary)
        return binary

    def arch_options(self, arch: str, target: str) -> list[str]:
        """The compiler options selecting ``arch`` for ``target``."""
        raise NotImplementedError

    def _compile(self, source: str, name: str, arch: str, args: list[str], target: str) -> bytes:
        program = ctypes.c_void_p()
        self.check(
            self._fn("CreateProgram")(ctypes.byref(program), source.encode(), name.encode(), 0, None, None),
            "CreateProgram",
        )
        try:
            argv = (ctypes.c_char_p * len(args))(*(a.encode() for a in args))
            if self._fn("CompileProgram")(program, len(args), argv) != 0:
                raise CompileError(f"{self.name}: {name} failed to compile for {arch}:\n{self._log(program)}")
            return self._output(program, self.getters[target])
        finally:
            self._fn("DestroyProgram")(ctypes.byref(program))

    def _output(self, program: ctypes.c_void_p, getter: str) -> bytes:
        size = ctypes.c_size_t()
        self.check(self._fn(f"Get{getter}Size")(program, ctypes.byref(size)), f"Get{getter}Size")
        out = ctypes.create_string_buffer(size.value)
        self.check(self._fn(f"Get{getter}")(program, out), f"Get{getter}")
        return out.raw

    def _log(self, program: ctypes.c_void_p) -> str:
        size = ctypes.c_size_t()
        if self._fn("GetProgramLogSize")(program, ctypes.byref(size)) != 0:
            return "(no log)"
        log = ctypes.create_string_buffer(max(size.value, 1))
        self._fn("GetProgramLog")(program, log)
        return log.value.decode(errors="replace")


class Nvrtc(RuntimeCompiler):
    """NVRTC. ``target`` is ``"cubin"`` (SASS for exactly ``arch``, e.g. ``sm_90``) or ``"ptx"``
    (``compute_90`` PTX the driver JIT-compiles, forward compatible with newer GPUs)."""

    name = "nvrtc"
    default_target = "cubin"
    getters: ClassVar[Mapping[str, str]] = {"cubin": "CUBIN", "ptx": "PTX"}

    def __init__(self, cache: ModuleCache | None = None) -> None:
        super().__init__(cache)
        library = _load_first(
            "nvrtc",
            "BATCHGPU_NVRTC",
            ("nvidia/cu*/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*"),
            ("libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"),
            "nvrtcCreateProgram",
        )
        self._bind(library)

    def supported_archs(self) -> list[int]:
        """Compute capabilities this NVRTC compiles for, as ints (``90`` for sm_90)."""
        count = ctypes.c_int()
        self.check(self.lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)), "GetNumSupportedArchs")
        archs = (ctypes.c_int * count.value)()
        self.check(self.lib.nvrtcGetSupportedArchs(archs), "GetSupportedArchs")
        return list(archs)

    def arch_options(self, arch: str, target: str) -> list[str]:
        number = arch.removeprefix("sm_").removeprefix("compute_")
        return [f"--gpu-architecture={'sm' if target == 'cubin' else 'compute'}_{number}"]


class Hiprtc(RuntimeCompiler):
    """hipRTC (ROCm). ``arch`` is the device's gcnArchName (``gfx90a``, ``gfx942:sramecc+:xnack-``);
    the result is a code object for hipModuleLoadData. Compiles here with Debian's ROCm 5.2 hipRTC
    (no AMD GPU needed); the code objects have not been loaded on AMD hardware yet."""

    name = "hiprtc"
    default_target = "code"
    getters: ClassVar[Mapping[str, str]] = {"code": "Code"}
    _lock = threading.Lock()  # ROCm 5.2's hipRTC segfaults under concurrent compiles (seen ~1 in 10 runs here)

    def __init__(self, cache: ModuleCache | None = None) -> None:
        super().__init__(cache)
        rocm = os.environ.get("ROCM_PATH", "/opt/rocm")
        # ROCm 6 ships hipRTC as libhiprtc; ROCm 5 (Debian 12's packages) exports it from libamdhip64.
        system = (f"{rocm}/lib/libhiprtc.so", "libhiprtc.so", "libhiprtc.so.6", "libamdhip64.so", "libamdhip64.so.5")
        self._bind(_load_first("hiprtc", "BATCHGPU_HIPRTC", (), system, "hiprtcCreateProgram"))

    def arch_options(self, arch: str, target: str) -> list[str]:
        return [f"--offload-arch={arch}"]

    def _compile(self, source: str, name: str, arch: str, args: list[str], target: str) -> bytes:
        with self._lock:
            return super()._compile(source, name, arch, args, target)


_compilers: dict[str, RuntimeCompiler] = {}


def compiler(vendor: str) -> RuntimeCompiler:
    """The process-wide NVRTC (``"cuda"``) or hipRTC (``"hip"``); raises UnsupportedError when absent."""
    if vendor not in _compilers:
        _compilers[vendor] = Nvrtc() if vendor == "cuda" else Hiprtc()
    return _compilers[vendor]

"""Runtime compilation of CUDA C++ with NVRTC (NVIDIA) or hipRTC (AMD), bound with ctypes, with an
on-disk cache of compiled modules keyed by source, options, architecture and compiler version.

NVRTC comes from the ``nvidia-cuda-nvrtc`` wheel (``site-packages/nvidia/cu13/lib`` or, for CUDA 12
wheels, ``nvidia/cuda_nvrtc/lib``) or the system; hipRTC from ROCm (``libhiprtc.so``, or
``libamdhip64.so.5`` on ROCm 5). Set
``BATCHGPU_NVRTC`` / ``BATCHGPU_HIPRTC`` to a library path to choose one. The cache lives under
``$BATCHGPU_CACHE_DIR`` (default ``$XDG_CACHE_HOME/batchgpu`` or ``~/.cache/batchgpu``); a second
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
from collections.abc import Sequence
from pathlib import Path

from .errors import CompileError, UnsupportedError

ENV_CACHE_DIR = "BATCHGPU_CACHE_DIR"
CACHE_FORMAT = 1
"""Bumped when what is stored (or how the key is made) changes."""


def cache_dir() -> Path:
    """Where compiled modules are kept: ``$BATCHGPU_CACHE_DIR`` or the platform user cache dir."""
    explicit = os.environ.get(ENV_CACHE_DIR)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "batchgpu"


class ModuleCache:
    """Compiled modules on disk, one file per key; written atomically (temp file + rename)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root

    @property
    def path(self) -> Path:
        return (self.root or cache_dir()) / "kernels"

    def get(self, key: str) -> bytes | None:
        try:
            return (self.path / key).read_bytes()
        except OSError:
            return None

    def put(self, key: str, data: bytes) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-")
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, self.path / key)
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
    (PTX or cubin for NVRTC, a code object for hipRTC) ready for cuModuleLoadData/hipModuleLoadData."""

    name: str
    lib: ctypes.CDLL
    version: tuple[int, int]

    def __init__(self, cache: ModuleCache | None = None) -> None:
        self.cache = cache if cache is not None else ModuleCache()
        self.compiled = 0  # compiler invocations (cache misses), for tests and stats

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise CompileError(f"{self.name}: {what} failed: {self._error_string(status)} ({status})")

    def _error_string(self, status: int) -> str:
        raise NotImplementedError

    def cache_key(self, source: str, arch: str, options: Sequence[str], target: str) -> str:
        digest = hashlib.sha256()
        for part in (str(CACHE_FORMAT), self.name, "{}.{}".format(*self.version), arch, target, *options, source):
            digest.update(part.encode())
            digest.update(b"\0")
        return f"{self.name}-{arch}-{target}-{digest.hexdigest()}"

    def compile(self, source: str, name: str, arch: str, options: Sequence[str] = (), target: str = "") -> bytes:
        """Compile ``source`` for ``arch`` (``sm_90`` / ``gfx90a``), from the disk cache when present."""
        target = target or self.default_target
        key = self.cache_key(source, arch, options, target)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        binary = self._compile(source, name, arch, list(options), target)
        self.compiled += 1
        self.cache.put(key, binary)
        return binary

    default_target = ""

    def _compile(self, source: str, name: str, arch: str, options: list[str], target: str) -> bytes:
        raise NotImplementedError


class Nvrtc(RuntimeCompiler):
    """NVRTC. ``target`` is ``"cubin"`` (SASS for exactly ``arch``, e.g. ``sm_90``) or ``"ptx"``
    (``compute_90`` PTX the driver JIT-compiles, forward compatible with newer GPUs)."""

    name = "nvrtc"
    default_target = "cubin"

    def __init__(self, cache: ModuleCache | None = None) -> None:
        super().__init__(cache)
        self.lib = _load_first(
            "nvrtc",
            "BATCHGPU_NVRTC",
            ("nvidia/cu*/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*"),
            ("libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"),
            "nvrtcCreateProgram",
        )
        lib = self.lib
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
        lib.nvrtcCreateProgram.argtypes = [
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
            ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p),
        ]  # fmt: skip
        lib.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        for getter in ("ProgramLog", "PTX", "CUBIN"):
            getattr(lib, f"nvrtcGet{getter}Size").argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
            getattr(lib, f"nvrtcGet{getter}").argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _error_string(self, status: int) -> str:
        return self.lib.nvrtcGetErrorString(status).decode()

    def supported_archs(self) -> list[int]:
        """Compute capabilities this NVRTC compiles for, as ints (``90`` for sm_90)."""
        count = ctypes.c_int()
        self.check(self.lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)), "nvrtcGetNumSupportedArchs")
        archs = (ctypes.c_int * count.value)()
        self.check(self.lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
        return list(archs)

    def _compile(self, source: str, name: str, arch: str, options: list[str], target: str) -> bytes:
        if target not in ("ptx", "cubin"):
            raise CompileError(f"nvrtc: target must be 'ptx' or 'cubin', got {target!r}")
        number = arch.removeprefix("sm_").removeprefix("compute_")
        gpu = f"--gpu-architecture={'sm' if target == 'cubin' else 'compute'}_{number}"
        program = ctypes.c_void_p()
        self.check(
            self.lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None),
            "nvrtcCreateProgram",
        )
        try:
            args = [gpu, *options]
            argv = (ctypes.c_char_p * len(args))(*(a.encode() for a in args))
            status = self.lib.nvrtcCompileProgram(program, len(args), argv)
            if status != 0:
                raise CompileError(f"nvrtc: {name} failed to compile for {arch}:\n{self._log(program)}")
            getter = "CUBIN" if target == "cubin" else "PTX"
            size = ctypes.c_size_t()
            self.check(getattr(self.lib, f"nvrtcGet{getter}Size")(program, ctypes.byref(size)), f"nvrtcGet{getter}Size")
            out = ctypes.create_string_buffer(size.value)
            self.check(getattr(self.lib, f"nvrtcGet{getter}")(program, out), f"nvrtcGet{getter}")
            return out.raw
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(program))

    def _log(self, program: ctypes.c_void_p) -> str:
        size = ctypes.c_size_t()
        if self.lib.nvrtcGetProgramLogSize(program, ctypes.byref(size)) != 0:
            return "(no log)"
        log = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetProgramLog(program, log)
        return log.value.decode(errors="replace")


class Hiprtc(RuntimeCompiler):
    """hipRTC (ROCm). ``arch`` is the device's gcnArchName (``gfx90a``, ``gfx942:sramecc+:xnack-``);
    the result is a code object for hipModuleLoadData. Compiles here with Debian's ROCm 5.2 hipRTC
    (no AMD GPU needed); the code objects have not been loaded on AMD hardware yet."""

    name = "hiprtc"
    default_target = "code"

    def __init__(self, cache: ModuleCache | None = None) -> None:
        super().__init__(cache)
        rocm = os.environ.get("ROCM_PATH", "/opt/rocm")
        # ROCm 6 ships hipRTC as libhiprtc; ROCm 5 (Debian 12's packages) exports it from libamdhip64.
        system = (f"{rocm}/lib/libhiprtc.so", "libhiprtc.so", "libhiprtc.so.6", "libamdhip64.so", "libamdhip64.so.5")
        self.lib = _load_first("hiprtc", "BATCHGPU_HIPRTC", (), system, "hiprtcCreateProgram")
        lib = self.lib
        lib.hiprtcGetErrorString.restype = ctypes.c_char_p
        lib.hiprtcGetErrorString.argtypes = [ctypes.c_int]
        lib.hiprtcCreateProgram.argtypes = [
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
            ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p),
        ]  # fmt: skip
        lib.hiprtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.hiprtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        for getter in ("ProgramLog", "Code"):
            getattr(lib, f"hiprtcGet{getter}Size").argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
            getattr(lib, f"hiprtcGet{getter}").argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.check(lib.hiprtcVersion(ctypes.byref(major), ctypes.byref(minor)), "hiprtcVersion")
        self.version = (major.value, minor.value)

    def _error_string(self, status: int) -> str:
        return self.lib.hiprtcGetErrorString(status).decode()

    def _compile(self, source: str, name: str, arch: str, options: list[str], target: str) -> bytes:
        program = ctypes.c_void_p()
        self.check(
            self.lib.hiprtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None),
            "hiprtcCreateProgram",
        )
        try:
            args = [f"--offload-arch={arch}", *options]
            argv = (ctypes.c_char_p * len(args))(*(a.encode() for a in args))
            if self.lib.hiprtcCompileProgram(program, len(args), argv) != 0:
                size = ctypes.c_size_t()
                self.lib.hiprtcGetProgramLogSize(program, ctypes.byref(size))
                log = ctypes.create_string_buffer(max(size.value, 1))
                self.lib.hiprtcGetProgramLog(program, log)
                text = log.value.decode(errors="replace")
                raise CompileError(f"hiprtc: {name} failed to compile for {arch}:\n{text}")
            size = ctypes.c_size_t()
            self.check(self.lib.hiprtcGetCodeSize(program, ctypes.byref(size)), "hiprtcGetCodeSize")
            out = ctypes.create_string_buffer(size.value)
            self.check(self.lib.hiprtcGetCode(program, out), "hiprtcGetCode")
            return out.raw
        finally:
            self.lib.hiprtcDestroyProgram(ctypes.byref(program))


_compilers: dict[str, RuntimeCompiler] = {}


def compiler(vendor: str) -> RuntimeCompiler:
    """The process-wide NVRTC (``"cuda"``) or hipRTC (``"hip"``); raises UnsupportedError when absent."""
    if vendor not in _compilers:
        _compilers[vendor] = Nvrtc() if vendor == "cuda" else Hiprtc()
    return _compilers[vendor]

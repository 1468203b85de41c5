"""Kernels of a native device: CUDA C++ compiled by NVRTC/hipRTC (:mod:`batchgpu.nvrtc`, with its disk
cache), loaded once per source as a :class:`Module` (unloaded when dropped), functions cached by entry."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Sequence
from typing import Any, NamedTuple

from ... import cuda_source
from ...errors import UnsupportedError
from ...kernels import Launch
from ..base import Stats
from .attributes import DeviceAttributes
from .driver import FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, Driver


class Module:
    """A loaded module (``cuModuleLoadData`` / ``hipModuleLoadData``), unloaded when dropped. Its
    functions are valid while it lives: whoever keeps a function handle keeps the module too."""

    __slots__ = ("driver", "handle", "name")

    def __init__(self, driver: Driver, image: bytes, name: str) -> None:
        handle = ctypes.c_void_p()
        driver.check(driver.module_load_data(ctypes.byref(handle), image), f"loading module {name}")
        self.driver = driver
        self.handle = int(handle.value or 0)
        self.name = name

    def function(self, entry: str, what: str) -> int:
        """The handle of the kernel ``entry``; ``what`` names it in the error."""
        handle = ctypes.c_void_p()
        self.driver.check(self.driver.module_get_function(ctypes.byref(handle), self.handle, entry.encode()), what)
        return int(handle.value or 0)

    def close(self) -> None:
        handle, self.handle = self.handle, 0
        if handle:
            self.driver.module_unload(handle)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # a half-made module, or the interpreter shutting down
            self.close()


class Function(NamedTuple):
    """A kernel function handle and the module that keeps it valid."""

    handle: int
    module: Module


class Programs:
    """Modules loaded once per source (compiled through the disk cache) and functions cached by entry,
    for ``arch`` / ``target`` with the compiler ``options`` the executor's vendor chose."""

    def __init__(
        self,
        driver: Driver,
        attrs: DeviceAttributes,
        stats: Stats,
        compiler: Any,
        arch: str,
        target: str = "",
        options: Sequence[str] = (),
    ) -> None:
        self.driver = driver
        self.attrs = attrs
        self.stats = stats
        self.compiler = compiler
        self.arch = arch
        self.target = target
        self.options = list(options)
        self._modules: dict[str, Module] = {}
        self._functions: dict[tuple[str, str], Function] = {}
        self._dynamic: dict[int, int] = {}  # function -> dynamic shared bytes allowed so far

    def function(self, launch: Launch) -> Function:
        source, name = cuda_source.render(launch)
        entry = cuda_source.entry_name(launch)
        key = (source, entry)
        function = self._functions.get(key)
        if function is None:
            module = self._modules.get(source)
            if module is None:
                image = self.compiler.compile(source, name, self.arch, self.options, self.target)
                module = self._modules[source] = Module(self.driver, image, name)
                self.stats.pipelines_compiled += 1
            handle = module.function(entry, f"{launch.label}: kernel {entry!r} in {name}")
            function = self._functions[key] = Function(handle, module)
        return function

    def allow_dynamic_shared(self, function: int, nbytes: int) -> None:
        """Opt a function in to more than the default 48 KiB of dynamic shared memory (CUDA)."""
        if nbytes <= self.attrs.max_shared_memory_per_block or nbytes <= self._dynamic.get(function, 0):
            return
        if self.driver.func_set_attribute is not None:
            self.driver.check(
                self.driver.func_set_attribute(function, FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
                f"allowing {nbytes} bytes of dynamic shared memory",
            )
        self._dynamic[function] = nbytes


def nvrtc_target(nvrtc: Any, arch: str) -> tuple[str, str]:
    """cubin for the device's own arch when this NVRTC knows it, else PTX of the newest arch below."""
    number = int(arch.removeprefix("sm_"))
    supported = nvrtc.supported_archs()
    if number in supported:
        return arch, "cubin"
    older = [a for a in supported if a <= number]
    if not older:
        raise UnsupportedError(f"nvrtc {nvrtc.version}: cannot compile for {arch} (supports {supported})")
    return f"sm_{max(older)}", "ptx"

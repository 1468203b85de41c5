"""Importing wgpu-py quickly.

Measured on lavapipe (benchmarks/cold_start.py), most of a new process's time to the first result is
not the GPU but cffi parsing C declarations with pycparser inside wgpu-py:

- ``import wgpu.backends.wgpu_native`` parses wgpu-native's whole header (``ffi.cdef``), about 0.3-0.4 s;
- every distinct C type wgpu-py names the first time (``ffi.new("WGPUDeviceDescriptor *")``) is
  parsed again with one ``typedef int X;`` line per known typedef (430 of them), 30-40 ms each and
  some 30 types to the first result.

:func:`import_wgpu` cuts both without changing what cffi builds:

- the parsed header (cffi's model objects) is pickled into ``<cache dir>/cffi/`` keyed by a hash of
  the header text and the cffi/pycparser/Python versions, and loaded in the next process instead of
  being parsed (unpickling is restricted to cffi's model classes);
- simple type strings (``NAME``, ``NAME *``, ``const NAME *``, ``NAME[]``, ``NAME[4]``) of wgpu's ffi
  are resolved straight from the declarations cffi already holds, as cffi's own parser would
  (``test_fast_type_lookup_equals_cffi_parser`` in tests/test_cache.py checks both give equal types for
  every type string in wgpu-py's source);
  anything else goes through cffi's parser.

``BATCHGPU_FAST_IMPORT=0`` turns both off.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
import re
import sys
import time
from types import ModuleType
from typing import Any

from . import cache

log = logging.getLogger("batchgpu")

ENV_FAST_IMPORT = "BATCHGPU_FAST_IMPORT"
_SIMPLE_TYPE = re.compile(r"^\s*(const\s+)?([A-Za-z_]\w*)\s*(const\s*)?(\*|\[\s*(\d*)\s*\])?\s*$")
_FUNCTION_TYPE = re.compile(r"^\s*([^()]+?)\s*\(([^()]*)\)\s*$")  # "void(WGPUMapAsyncStatus, void *)"
_PICKLE_MODULES = ("cffi.model", "builtins", "copyreg")
stats = {"header_cache": "unused", "fast_types": 0, "slow_types": 0, "import_s": 0.0}


def enabled() -> bool:
    return os.environ.get(ENV_FAST_IMPORT, "1").strip().lower() not in ("0", "off", "false", "no")


def import_wgpu() -> ModuleType:
    """``import wgpu`` with its wgpu-native backend loaded, using the header cache and the fast type
    lookup unless disabled."""
    started = time.perf_counter()
    fast = enabled()
    if fast and "wgpu.backends.wgpu_native._ffi" not in sys.modules:
        with _header_cache():
            import wgpu.backends.wgpu_native
    import wgpu
    import wgpu.backends.wgpu_native

    if fast:
        install_fast_types(wgpu.backends.wgpu_native._ffi.ffi)
    stats["import_s"] = time.perf_counter() - started
    return wgpu


# the parsed header, cached across processes -----------------------------------------------------


class _ModelUnpickler(pickle.Unpickler):
    """Only cffi's model classes (and plain builtins) may come out of a cached header."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _PICKLE_MODULES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a cffi header cache")


class _header_cache:
    """While active, ``FFI.cdef(source)`` of a header parsed before loads it from the cache dir."""

    def __enter__(self) -> None:
        import cffi
        import pycparser

        self._api = cffi.api
        self._original = self._api.FFI._cdef
        folder = cache.subdir("cffi")
        if folder is None:  # no header cache; the fast type lookup is installed after the import
            return
        versions = f"cffi {cffi.__version__} pycparser {pycparser.__version__} python {sys.version}"
        original = self._original

        def cdef(ffi: Any, csource: Any, override: bool = False, **options: Any) -> None:
            if override or any(options.values()) or not isinstance(csource, str):
                return original(ffi, csource, override=override, **options)
            digest = hashlib.sha256((versions + "\0" + csource).encode()).hexdigest()[:32]
            path = folder / f"header-{digest}.pickle"
            if not _load_header(ffi, csource, path):
                original(ffi, csource, override=override, **options)
                _save_header(ffi, path)
            install_fast_types(ffi)  # before wgpu-py's import names its first types
            return None

        self._api.FFI._cdef = cdef

    def __exit__(self, *exc: object) -> None:
        self._api.FFI._cdef = self._original


def _load_header(ffi: Any, csource: str, path: Any) -> bool:
    parser = ffi._parser
    if parser._declarations or not path.exists():  # only a fresh FFI, as wgpu-py makes one
        stats["header_cache"] = "miss"
        return False
    try:
        declarations, int_constants, counter = _ModelUnpickler(io.BytesIO(path.read_bytes())).load()
    except Exception as exc:  # a corrupt or foreign file: parse instead
        log.debug("cffi header cache %s unusable (%s); parsing", path, exc)
        stats["header_cache"] = "miss"
        return False
    with ffi._lock:
        ffi._cdef_version = object()
        parser._declarations = declarations
        parser._int_constants = int_constants
        parser._anonymous_counter = counter
        ffi._cdefsources.append(csource)
    stats["header_cache"] = "hit"
    log.debug("cffi header cache hit: %s", path)
    return True


def _save_header(ffi: Any, path: Any) -> None:
    parser = ffi._parser
    if parser._recomplete or parser._included_declarations:
        return  # states this cache does not reproduce
    try:
        data = pickle.dumps((parser._declarations, parser._int_constants, parser._anonymous_counter), protocol=4)
        cache.write_atomic(path, data)
        log.debug("cffi header cache written: %s", path)
    except Exception as exc:
        log.debug("cffi header cache not written (%s)", exc)


# fast lookup of simple type strings ----------------------------------------------------------


def install_fast_types(ffi: Any) -> None:
    """Resolve simple type strings of ``ffi`` from its declarations instead of re-parsing them."""
    parser = ffi._parser
    if getattr(parser, "_batchgpu_fast", False):
        return
    from cffi import model
    from cffi.commontypes import resolve_common_type

    slow = parser.parse_type_and_quals

    def parse_type_and_quals(cdecl: str) -> tuple[Any, int]:
        resolved = fast_type(parser, cdecl, model, resolve_common_type)
        if resolved is None:
            stats["slow_types"] += 1
            return slow(cdecl)
        stats["fast_types"] += 1
        return resolved

    parser.parse_type_and_quals = parse_type_and_quals
    parser._batchgpu_fast = True


def fast_type(parser: Any, cdecl: str, model: Any, resolve_common_type: Any) -> tuple[Any, int] | None:
    """The (type, qualifiers) cffi's parser gives for a simple type string, or None when not simple.

    Mirrors ``cffi.cparser.Parser._get_type_and_quals`` for a typedef name or a one-word primitive,
    optionally const, as is, as a pointer, or as an array; and ``_parse_function_type`` for a function
    type (callback signature) whose result and arguments are such simple types."""
    match = _SIMPLE_TYPE.match(cdecl)
    if match is None:
        function = _FUNCTION_TYPE.match(cdecl)
        if function is None:
            return None
        result = fast_type(parser, function.group(1), model, resolve_common_type)
        names = [a.strip() for a in function.group(2).split(",")] if function.group(2).strip() else []
        if names == ["void"]:
            names = []
        args = [fast_type(parser, name, model, resolve_common_type) for name in names]
        if result is None or any(a is None or a[0] is model.void_type for a in args) or "..." in names:
            return None
        arg_types = []
        for tp, quals in args:  # type: ignore[misc]
            if isinstance(tp, model.ArrayType):
                tp = model.PointerType(tp.item, quals)
            elif isinstance(tp, model.RawFunctionType):
                tp = tp.as_function_pointer()
            arg_types.append(tp)
        return model.RawFunctionType(tuple(arg_types), result[0], False, None), 0
    const_before, name, const_after, suffix, length = match.groups()
    declared = parser._declarations.get("typedef " + name)
    if declared is not None:
        base, quals = declared
    elif name == "void":
        base, quals = model.void_type, 0
    elif name in model.PrimitiveType.ALL_PRIMITIVE_TYPES or name.endswith("_t"):
        if name in ("signed", "unsigned", "short", "long"):
            return None  # spelled-out integer types take cffi's normalization
        try:
            base, quals = resolve_common_type(parser, name)
        except Exception:
            return None
    else:
        return None
    if const_before or const_after:
        quals |= model.Q_CONST
    if suffix is None:
        return base, quals
    if suffix == "*":
        if isinstance(base, model.RawFunctionType):
            return base.as_function_pointer(), 0
        return model.PointerType(base, quals), 0
    return model.ArrayType(base, int(length) if length else None), quals

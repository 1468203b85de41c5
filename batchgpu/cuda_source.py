"""CUDA C++ sources of the built-in kernels (``shaders/cuda/<family>.cu``), specialized per launch.

A :class:`~batchgpu.kernels.Launch` names a shader family, WGSL type aliases, op snippets and override
constants. For the native executors each of those becomes a ``#define`` in front of the family's source
(after ``prelude.cuh``): one module per specialization, its ``extern "C"`` kernels named like the WGSL
entry points. Op expressions are not translated from WGSL text: :data:`UNARY` and :data:`BINARY` give
the CUDA expression of each op by name (the launch's label).

Kernel arguments follow the WGSL binding slots: slot ``i`` is argument ``i``; a storage binding is a
device pointer (NULL where the launch binds nothing), the ``uniform`` slot is the ``Params`` struct
passed by value (the launch's ``params`` bytes, the same layout as the WGSL struct) and the
``scalars`` slot is a pointer to the per-execute scalar buffer (64 x 4 bytes).
"""

from __future__ import annotations

import functools

from .errors import UnsupportedError
from .kernels import Launch
from .shaders import shader_root

CUDA_TYPE = {"f32": "float", "f16": "bg_half", "i32": "int", "u32": "unsigned"}
"""CUDA type of each WGSL scalar type used in type aliases (float16 is a 2-byte storage struct)."""

GELU_C = "0.7978845608028654f"

UNARY: dict[str, str] = {
    "neg": "-x",
    "abs": "bg_abs(x)",
    "exp": "expf(x)",
    "log": "logf(x)",
    "sqrt": "sqrtf(x)",
    "rsqrt": "rsqrtf(x)",
    "tanh": "bg_is_nan(x) ? x : tanhf(bg_clamp(x, -15.0f, 15.0f))",
    "sigmoid": "1.0f / (1.0f + expf(-x))",
    "relu": "bg_max_nan(x, (C)0)",
    "gelu": "bg_gelu_erf(x)",
    "gelu_tanh": f"0.5f * x * (1.0f + tanhf(bg_clamp({GELU_C} * (x + 0.044715f * x * x * x), -15.0f, 15.0f)))",
    "silu": "x / (1.0f + expf(-x))",
    "copy": "x",
    "cast": "x",
}
"""CUDA expression of ``x`` (in the compute type C) for every unary op, same math as the WGSL ones in
``batchgpu/ops/elementwise.py``."""

BINARY: dict[str, str] = {
    "add": "x + y",
    "sub": "x - y",
    "mul": "x * y",
    "div": "x / y",
    "maximum": "bg_max_nan(x, y)",
    "minimum": "bg_min_nan(x, y)",
    "silu_mul": "x / (1.0f + expf(-x)) * y",
}

FAMILY_ARGS: dict[str, int] = {
    "elementwise": 4,
    "copy": 3,
    "reduce": 3,
    "softmax": 4,
    "matmul": 5,
    "norm": 7,
    "attention": 9,
    "gather": 6,
    "qmatmul": 5,
}
"""Kernel arguments of each family's entry points (one per WGSL binding slot)."""

RUNTIME_CONSTANTS: dict[str, frozenset[str]] = {"attention": frozenset({"SMAX", "HEAD_DIM"})}
"""Override constants the CUDA kernels take at launch (dynamic shared memory), not as #defines."""

FAMILIES = tuple(FAMILY_ARGS)


@functools.cache
def _read(name: str) -> str:
    return (shader_root() / "cuda" / name).read_text()


def prelude() -> str:
    return _read("prelude.cuh")


def family_source(family: str) -> str:
    return _read(f"{family}.cu")


def _literal(value: float | bool) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number) + "f"


def defines(launch: Launch) -> list[str]:
    """The lines specializing ``launch.family`` after the prelude: types, op expressions, constants."""
    lines = []
    types = dict(launch.types)
    for alias, wgsl_type in launch.types:
        lines.append(f"typedef {CUDA_TYPE[wgsl_type]} {alias};")
    for alias in ("A", "B", "O", "C"):
        if alias not in types:  # families declare every alias; fill unused ones with float
            lines.append(f"typedef float {alias};")
    for name, _ in launch.snippets:
        table = UNARY if name == "UNARY" else BINARY
        expression = table.get(launch.label)
        if expression is None:
            raise UnsupportedError(f"{launch.label}: no CUDA expression for this op (see batchgpu/cuda_source.py)")
        lines.append(f"#define {name}_EXPR ({expression})")
    skip = RUNTIME_CONSTANTS.get(launch.family, frozenset())
    lines += [f"#define {name} {_literal(value)}" for name, value in launch.constants if name not in skip]
    return lines


def render(launch: Launch) -> tuple[str, str]:
    """(source, display name) of the module ``launch`` runs, for NVRTC or hipRTC."""
    if launch.kernel is not None:
        cuda = getattr(launch.kernel, "cuda", None)
        if not cuda:
            raise UnsupportedError(
                f"{launch.label}: kernel {launch.kernel.name!r} has no CUDA source; create it with "
                f"Kernel(wgsl=..., cuda=...) to run it on a native device"
            )
        return f"#define WG {launch.workgroup_size[0]}\n{prelude()}\n{cuda}", f"{launch.kernel.name}.cu"
    specialization = "\n".join(defines(launch))
    return (
        f"#define WG {launch.workgroup_size[0]}\n{prelude()}\n{specialization}\n{family_source(launch.family)}",
        f"{launch.family}.cu",
    )


def entry_name(launch: Launch) -> str:
    """The CUDA function ``launch`` calls: the family kernel's entry, or a custom kernel's ``cuda_entry``."""
    return launch.kernel.cuda_entry if launch.kernel is not None else launch.entry


def argument_count(launch: Launch) -> int:
    if launch.kernel is not None:
        return len(launch.bindings)
    return FAMILY_ARGS[launch.family]


def dynamic_shared_bytes(launch: Launch) -> int:
    """Bytes of dynamic shared memory the CUDA kernel of ``launch`` needs."""
    if launch.family == "attention" and launch.entry in ("attention", "attention_partial"):  # scores, query row
        constants = dict(launch.constants)
        return 4 * (int(constants["SMAX"]) + int(constants["HEAD_DIM"]))
    return 0

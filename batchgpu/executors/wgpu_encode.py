"""Encoding a plan's dispatches into a compute pass, the wgpu executor's hot loop.

Two paths with one result. The plain path calls wgpu-py's methods (``set_pipeline``, ``set_bind_group``,
``dispatch_workgroups``); each wraps its C call in error capture and builds an empty dynamic-offset array,
most of the host time of a dispatch. The direct path calls the same wgpu-native C functions through
wgpu-py's own cffi library with the handles wgpu-py holds, and skips ``set_pipeline`` when the pipeline
does not change. Those functions only record commands: wgpu validates a compute pass when it ends and
the encoder finishes, which both paths do through wgpu-py, so both raise the same errors at the same call
(the executor's error path then re-encodes dispatches one by one through the plain path to name the
culprit). ``BATCHGPU_WGPU_ENCODE=plain`` selects the plain path (for debugging, and for comparing the two).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

ENV = "BATCHGPU_WGPU_ENCODE"

Dispatch = tuple[Any, Any, int, int, int]
"""(pipeline, bind group, x, y, z) as wgpu-py objects."""


def encode_plain(compute: Any, dispatches: Sequence[Dispatch]) -> None:
    """Record ``dispatches`` through wgpu-py's methods."""
    for pipeline, bind_group, x, y, z in dispatches:
        compute.set_pipeline(pipeline)
        compute.set_bind_group(0, bind_group)
        compute.dispatch_workgroups(x, y, z)


class DirectEncoder:
    """Records dispatches through wgpu-native's C functions (see the module docstring)."""

    def __init__(self, lib: Any, ffi: Any) -> None:
        self.set_pipeline = lib.wgpuComputePassEncoderSetPipeline
        self.set_bind_group = lib.wgpuComputePassEncoderSetBindGroup
        self.dispatch = lib.wgpuComputePassEncoderDispatchWorkgroups
        self.null = ffi.NULL

    @staticmethod
    def handles(dispatches: Sequence[Dispatch]) -> list[tuple[Any, Any, int, int, int]]:
        """The C handles of ``dispatches`` (computed once per plan; the plan keeps the objects alive), the
        pipeline None where it repeats the previous dispatch's."""
        calls, previous = [], None
        for pipeline, bind_group, x, y, z in dispatches:
            calls.append((None if pipeline is previous else pipeline._internal, bind_group._internal, x, y, z))
            previous = pipeline
        return calls

    def encode(self, compute: Any, calls: Sequence[tuple[Any, Any, int, int, int]]) -> None:
        """Record ``calls`` (from :meth:`handles`) into the compute pass ``compute`` (a wgpu-py object)."""
        encoder = compute._internal
        set_pipeline, set_bind_group, dispatch, null = self.set_pipeline, self.set_bind_group, self.dispatch, self.null
        for pipeline, bind_group, x, y, z in calls:
            if pipeline is not None:
                set_pipeline(encoder, pipeline)
            set_bind_group(encoder, 0, bind_group, 0, null)
            dispatch(encoder, x, y, z)


def direct_encoder(device: Any) -> DirectEncoder | None:
    """The direct path for a device of wgpu-py's native backend, or None: another backend, a wgpu-py
    without the names this relies on, or ``BATCHGPU_WGPU_ENCODE=plain``."""
    if os.environ.get(ENV, "direct") == "plain":
        return None
    try:
        from wgpu.backends.wgpu_native import _api
    except ImportError:
        return None
    lib, ffi = getattr(_api, "lib", None), getattr(_api, "ffi", None)
    names = ("wgpuComputePassEncoderSetPipeline", "wgpuComputePassEncoderSetBindGroup")
    if not isinstance(device, getattr(_api, "GPUDevice", ())) or lib is None or ffi is None:
        return None
    if not all(hasattr(lib, name) for name in (*names, "wgpuComputePassEncoderDispatchWorkgroups")):
        return None
    return DirectEncoder(lib, ffi)

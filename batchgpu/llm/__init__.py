"""Serving LLM generations: an engine that batches many concurrent requests through one recorded
decode step (paged KV cache, chunked prefill, sampling on the device; outputs held to a JSON schema or a
grammar, tool calls), and an OpenAI-compatible server."""

from __future__ import annotations

from .engine import Engine
from .output import Piece
from .params import SamplingParams
from .prompt import Prompt
from .structured import StructuredOutput
from .tools import Function, ToolCall, ToolCalling

__all__ = ["Engine", "Function", "Piece", "Prompt", "SamplingParams", "StructuredOutput", "ToolCall", "ToolCalling"]

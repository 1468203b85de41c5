"""Where each weight buffer of an exported model comes from in its GGUF file, so a page builds the buffers from
the file itself (fetched once) instead of a copy of the device's bytes.

A resident weight is the file's bytes with up to four changes, each described for the page's ``batchgpu.js``:

- ``parts``: the tensors it joins, in order (q/k/v concatenated; gate/up with ``interleave``: row ``2i`` is
  gate's row ``i``, row ``2i + 1`` up's), each ``{"offset", "rows", "row_bytes", "heads"}``;
- ``heads`` > 0: llama.cpp's q/k row permutation undone (:func:`~batchgpu.models.gguf_file.unpermute_rows`):
  row ``h * n + 2 * b + a`` of the file (``n`` rows per head) is row ``h * n + a * n / 2 + b``;
- ``first_row``, ``rows``: the rows of the joined matrix the buffer holds (a row piece over a binding limit);
- ``span``: ``[start, end)``, the file bytes it is built from;
- ``format``: GGUF blocks of ``block_bytes`` repacked to ``device_bytes`` with the bytes at ``segments``
  (``[source offset, length, target offset]``; :class:`~batchgpu.quant.BlockFormat`), or None.

:func:`weight_sources` derives each description and checks it against the device's bytes (:func:`assemble`
is the page's algorithm in numpy); a weight whose bytes it cannot derive gets no source, and the export
writes its bytes instead.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..models.gguf_file import PERMUTED_TENSORS
from ..models.gguf_reader import GGUFFile
from ..models.llama import FUSED_PROJECTIONS, LlamaConfig
from ..models.row_pieces import RowPieces, Weight
from ..quant import quant_format, repack_blocks
from ..tensor import Storage, Tensor

Source = dict[str, Any]
_BLOCK = re.compile(r"(blk\.\d+\.)(.+)")


def weight_sources(
    file: GGUFFile,
    config: LlamaConfig,
    weights: Mapping[str, Weight],
    device_bytes: Callable[[Storage], bytes],
) -> dict[Storage, Source]:
    """The GGUF source of every weight storage whose device bytes (``device_bytes(storage)``) it reproduces."""
    sources: dict[Storage, Source] = {}
    for name, weight in weights.items():
        parts = _parts(file, config, name)
        if parts is None:
            continue
        pieces = weight.pieces if isinstance(weight, RowPieces) else (weight,)
        first = 0
        for piece in pieces:
            source = _source(parts, name, piece, first)
            first += piece.shape[0]
            stored = device_bytes(piece.storage)
            if assemble(file.bytes, source) == stored[: piece.storage.nbytes]:
                sources[piece.storage] = source
    return sources


def _split(name: str) -> tuple[str, str]:
    """``"blk.3.attn_qkv.weight"`` -> ``("blk.3.", "attn_qkv.weight")``; ``("", name)`` outside the blocks."""
    found = _BLOCK.match(name)
    return (found.group(1), found.group(2)) if found else ("", name)


def _parts(file: GGUFFile, config: LlamaConfig, name: str) -> list[dict[str, Any]] | None:
    """The file tensors a weight joins, as ``parts`` entries; None where one is missing."""
    prefix, short = _split(name)
    names = [prefix + part for part in FUSED_PROJECTIONS[short][0]] if short in FUSED_PROJECTIONS else [name]
    parts = []
    for part in names:
        tensor = file.tensors.get(part)
        if tensor is None:
            return None
        rows = tensor.shape[0]
        heads = 0
        if config.permuted and part.endswith(PERMUTED_TENSORS):
            heads = config.heads if "attn_q" in part else config.kv_heads
        parts.append({"offset": tensor.offset, "rows": rows, "row_bytes": tensor.size // rows, "heads": heads})
    return parts


def _source(parts: list[dict[str, Any]], name: str, piece: Tensor, first_row: int) -> Source:
    interleave = FUSED_PROJECTIONS.get(_split(name)[1], ((), False))[1]
    qtype = getattr(piece, "qtype", None)
    fmt = None
    if qtype is not None:
        block = quant_format(qtype)
        fmt = {
            "block_bytes": block.gguf_bytes,
            "device_bytes": block.device_bytes,
            "segments": [list(s) for s in block.segments or ((0, block.gguf_bytes, 0),)],
        }
    rows = piece.shape[0]
    if len(parts) == 1 and not parts[0]["heads"]:
        start = parts[0]["offset"] + first_row * parts[0]["row_bytes"]
        span = [start, start + rows * parts[0]["row_bytes"]]
    else:
        span = [min(p["offset"] for p in parts), max(p["offset"] + p["rows"] * p["row_bytes"] for p in parts)]
    return {"parts": parts, "interleave": interleave, "first_row": first_row, "rows": rows, "format": fmt, "span": span}


def source_row(parts: list[dict[str, Any]], interleave: bool, row: int) -> tuple[int, int]:
    """(file offset, bytes) of row ``row`` of the joined matrix."""
    if interleave:
        part, index = parts[row % len(parts)], row // len(parts)
    else:
        for part in parts:
            if row < part["rows"]:
                index = row
                break
            row -= part["rows"]
        else:
            raise IndexError(row)
    heads = part["heads"]
    if heads:  # llama.cpp's permutation: file row h*n + 2b + a holds the model's row h*n + a*n/2 + b
        per_head = part["rows"] // heads
        head, within = divmod(index, per_head)
        half, b = divmod(within, per_head // 2)
        index = head * per_head + 2 * b + half
    return part["offset"] + index * part["row_bytes"], part["row_bytes"]


def assemble(data: Any, source: Source) -> bytes:
    """A weight buffer's bytes from the file's bytes ``data``, as the page builds them."""
    parts, first, count = source["parts"], source["first_row"], source["rows"]
    if len(parts) == 1 and not parts[0]["heads"]:  # consecutive rows of one tensor: one range
        size = parts[0]["row_bytes"]
        start = parts[0]["offset"] + first * size
        return _repacked(np.asarray(data[start : start + count * size], np.uint8), source["format"])
    rows = []
    for row in range(first, first + count):
        offset, size = source_row(source["parts"], source["interleave"], row)
        rows.append(np.asarray(data[offset : offset + size], np.uint8))
    return _repacked(np.concatenate(rows), source["format"])


def _repacked(joined: np.ndarray, fmt: dict[str, Any] | None) -> bytes:
    if fmt is not None:  # the manifest's description, as the page applies it
        joined = repack_blocks(joined.reshape(-1, fmt["block_bytes"]), fmt["device_bytes"], fmt["segments"])
    return joined.tobytes()

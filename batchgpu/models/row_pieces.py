"""Weight matrices larger than one storage binding, held as row pieces.

A device binds at most ``max_storage_buffer_binding_size`` bytes per buffer (128 MiB on lavapipe and in
browsers): a 262,144 x 640 Q8_0 token embedding (Gemma 3 270M) or a 151,936 x 896 float16 one (Qwen2.5
0.5B) is larger. Every matrix the decoder holds is used row by row (the embedding gathers rows, each
projection is ``x @ W.T``: output column j is row j), so such a matrix is uploaded as consecutive pieces of
whole rows (whole blocks of its format), each within the limit, and :func:`embed` / :func:`project` compute
over the pieces what the ops compute over the whole: rows gathered piece by piece (ids outside a piece give
zero rows, so the pieces' rows add up exactly), logits as the pieces' matmuls concatenated along the last
axis. A matrix that fits is one tensor and records exactly the ops it did before."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from ..batch import GpuCommandBatch
from ..device import Device
from ..quant import quant_format
from ..tensor import Tensor


@dataclass(frozen=True)
class RowPieces:
    """A (rows, K) weight matrix as resident tensors of consecutive rows (the first piece's rows, then the
    next's, ...), each within the device's binding limit."""

    pieces: tuple[Tensor, ...]
    name: str

    @property
    def shape(self) -> tuple[int, int]:
        return sum(piece.shape[0] for piece in self.pieces), self.pieces[0].shape[1]

    @property
    def starts(self) -> list[int]:
        """The first row of each piece."""
        return [0, *accumulate(piece.shape[0] for piece in self.pieces[:-1])]


Weight = Tensor | RowPieces
"""A resident weight as the decoder reads it: one tensor, or row pieces where it exceeds a binding."""


def tensors(weight: Weight) -> tuple[Tensor, ...]:
    """The resident tensors holding ``weight``."""
    return weight.pieces if isinstance(weight, RowPieces) else (weight,)


def device_row_bytes(data: np.ndarray, qtype: str | None, k: int) -> int:
    """Bytes one row of a (rows, ``k``) matrix takes on the device: its blocks' device words for a block
    format, else ``k`` values of ``data``'s dtype."""
    if qtype is None:
        return k * np.dtype(data.dtype).itemsize
    block = quant_format(qtype)
    return k // block.weights * block.device_bytes


def piece_rows(device: Device, row_bytes: int, multiple: int = 1) -> int:
    """The most rows, a multiple of ``multiple``, one piece can hold on ``device``: whole rows within
    ``max_storage_buffer_binding_size`` and ``max_buffer_size`` (0 where not even ``multiple`` rows fit)."""
    limits = device.limits
    rows = min(limits.max_storage_buffer_binding_size, limits.max_buffer_size) // row_bytes
    return rows - rows % multiple


def upload_matrix(
    device: Device, data: np.ndarray, qtype: str | None, shape: tuple[int, ...], *, name: str, multiple: int = 1
) -> Weight:
    """``data`` resident on ``device``: a float array (``qtype`` None) or GGUF block bytes of a (rows, K)
    matrix in format ``qtype``. A matrix over the binding limit becomes :class:`RowPieces` of at most
    :func:`piece_rows` rows each (``multiple``: pieces keep rows in groups, the interleaved gate/up pairs of
    ``matmul(..., epilogue="swiglu")``); anything else is one tensor (and a tensor no row cut can fit is
    refused by the device with LimitError, as before)."""
    if len(shape) == 2:
        rows, k = shape
        per = piece_rows(device, device_row_bytes(data, qtype, k), multiple)
        if 0 < per < rows:
            matrix, cuts = data.reshape(rows, -1), [(a, min(a + per, rows)) for a in range(0, rows, per)]
            pieces = tuple(upload_one(device, matrix[a:b], qtype, (b - a, k), f"{name}[{a}:{b}]") for a, b in cuts)
            return RowPieces(pieces, name)
    return upload_one(device, data, qtype, shape, name)


def upload_one(device: Device, data: np.ndarray, qtype: str | None, shape: tuple[int, ...], name: str) -> Tensor:
    """One resident tensor: ``Device.tensor`` of float data, ``Device.quantized`` of blocks."""
    if qtype is None:
        return device.tensor(data, name=name)
    return device.quantized(data, qtype, (shape[0], shape[1]), name=name)


def embed(batch: GpuCommandBatch, ids: Tensor, table: Weight) -> Tensor:
    """``batch.embedding(ids, table)`` over a table of any pieces: each piece gathers ``ids - start`` (ids
    outside it give zero rows; ids stay within int32, a table having fewer than 2^31 rows) and the pieces'
    rows are added, each sum exact (every row but one is zero)."""
    if isinstance(table, Tensor):
        return batch.embedding(ids, table)
    rows = [
        batch.embedding(ids if start == 0 else batch.sub(ids, start), piece)
        for start, piece in zip(table.starts, table.pieces)
    ]
    total = rows[0]
    for more in rows[1:]:
        total = batch.add(total, more)
    return total


def project(
    batch: GpuCommandBatch, x: Tensor, weight: Weight, *, bias: Tensor | None = None, epilogue: str | None = None
) -> Tensor:
    """``batch.matmul(x, weight, transpose_b=True, bias=bias, epilogue=epilogue)`` over a weight of any
    pieces: each piece's matmul (with its slice of ``bias``) gives its columns of the output, concatenated
    along the last axis (the ``swiglu`` epilogue halves each piece's columns: pieces hold whole pairs)."""
    if isinstance(weight, Tensor):
        return batch.matmul(x, weight, transpose_b=True, bias=bias, epilogue=epilogue)
    parts = []
    for start, piece in zip(weight.starts, weight.pieces):
        part_bias = None if bias is None else batch.slice(bias, (slice(start, start + piece.shape[0]),))
        parts.append(batch.matmul(x, piece, transpose_b=True, bias=part_bias, epilogue=epilogue))
    return batch.concat(parts, axis=-1)

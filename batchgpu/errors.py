"""One error hierarchy for everything the library raises on bad input or device trouble."""

from __future__ import annotations


class BatchError(Exception):
    """Base class of every batchgpu error."""


class ArgumentError(BatchError, TypeError):
    """An argument of the wrong kind: not a Tensor where one is needed, a resident tensor where a batch
    tensor is needed, a numpy array where a Tensor is needed, malformed feeds or scalars."""


class ShapeError(BatchError, ValueError):
    """An op got tensors whose shapes do not fit together."""


class DTypeError(BatchError, TypeError):
    """An op got a dtype it does not support, or dtypes that do not match."""


class DeviceMismatchError(BatchError, ValueError):
    """A tensor belongs to another batch or another device."""


class NotExecutedError(BatchError, RuntimeError):
    """A tensor was read before the batch that produces it was executed."""


class LimitError(BatchError, ValueError):
    """A size or launch configuration exceeds a queried device limit."""


class CompileError(BatchError, RuntimeError):
    """A shader (built-in or custom) failed to compile; carries the shader name and compiler message."""


class DeviceError(BatchError, RuntimeError):
    """The device reported an error (validation, lost device, failed mapping)."""


class UnsupportedError(BatchError, NotImplementedError):
    """The executor or adapter lacks a feature the op needs, or the decoder a computation a model's config asks
    for (a config.json key's value other than its neutral ones: batchgpu/models/hf_keys.py)."""


class RequestError(BatchError, ValueError):
    """A generation request the LLM engine refuses (bad sampling parameters, a prompt longer than the
    context, no room in the KV cache); other requests are not affected. ``param``: the request field at
    fault, where there is one (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class OverloadedError(RequestError):
    """A request refused because the engine already holds as many sequences as it takes (running, waiting
    or being tokenized: ``max_batch + max_waiting``): nothing was tokenized, queued or allocated for it, and
    the same request may succeed later (the server answers 429)."""


class GrammarError(RequestError):
    """A structured request's grammar cannot go on (a token it refuses, or the grammar engine's limits
    reached while generating): that request fails alone."""


class ExportError(BatchError, BufferError):
    """A tensor cannot be shared through ``__dlpack__`` / ``__cuda_array_interface__`` (a BufferError,
    as DLPack consumers expect)."""


class ModelFileError(BatchError, ValueError):
    """A model file or directory that cannot be what it claims (a path outside the model directory, a
    header or metadata field out of range, data past the end of the file): names the file and the field,
    with expected vs actual, and is raised before anything sized by the bad value is allocated."""

"""Recognising out-of-memory errors, the outcome of an attempt, and releasing what a failed attempt held.

OOM detection lives in this file only. ``torch.OutOfMemoryError`` is matched by type first;
backends that raise a plain ``RuntimeError`` are matched on their documented messages second.
Every other exception is left alone.
"""

from __future__ import annotations

import enum
import gc
import traceback

import torch

__all__ = ["ElasticOOMError", "Status", "is_oom_error", "release_memory", "status_of"]


class ElasticOOMError(torch.OutOfMemoryError):
    """Out of memory where splitting cannot help: at the smallest microbatch, or outside the microbatches."""


class Status(enum.IntEnum):
    """The outcome of an attempt, or of any phase every rank votes on: the worst over ranks wins."""

    OK = 0
    OOM = 1
    ERROR = 2


# Messages of allocators that raise RuntimeError rather than torch.OutOfMemoryError.
_OOM_MESSAGES = (
    "CUDA out of memory",  # CUDA caching allocator (older torch raised RuntimeError)
    "CUDA error: out of memory",  # CUDA driver / kernel launch
    "HIP out of memory",  # ROCm caching allocator
    "hipErrorOutOfMemory",  # ROCm runtime
    "XPU out of memory",  # Intel GPU allocator
    "MPS backend out of memory",  # Apple MPS allocator
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS workspace allocation
    "CUDNN_STATUS_ALLOC_FAILED",  # cuDNN workspace allocation
    "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",  # cuDNN workspace too large for free memory
    "Device out of memory",  # Habana HPU
    "PT_DEVMEM Allocation failed",  # Habana HPU device memory pool
)


def is_oom_error(exc: BaseException) -> bool:
    """Tell whether an exception means the device (or host) ran out of memory.

    Args:
        exc: Any exception.

    Returns:
        ``True`` for ``torch.OutOfMemoryError`` and for ``RuntimeError``s carrying one of the
        documented out-of-memory messages of CUDA, HIP, XPU, MPS, the CPU allocator,
        cuBLAS/cuDNN workspaces and HPU; ``False`` for everything else.

    Example:
        >>> import torch
        >>> from elastic_batches import is_oom_error
        >>> is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
        True
        >>> is_oom_error(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
        True
        >>> is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
        False
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError):  # torch.AcceleratorError (CUDA runtime errors) subclasses it
        return False
    message = str(exc)
    return any(pattern in message for pattern in _OOM_MESSAGES)


def status_of(exc: BaseException) -> Status:
    """``Status.OOM`` for an out-of-memory error (:func:`is_oom_error`), ``Status.ERROR`` for any other.

    Example:
        >>> import torch
        >>> from elastic_batches.oom import status_of
        >>> status_of(torch.OutOfMemoryError("CUDA out of memory")).name, status_of(KeyError("x")).name
        ('OOM', 'ERROR')
    """
    return Status.OOM if is_oom_error(exc) else Status.ERROR


def release_memory(exc: BaseException | None = None) -> None:
    """Drop what a failed attempt still holds and hand cached device memory back.

    The frames of ``exc``'s traceback keep the failed microbatch's tensors (inputs,
    activations, partial losses) alive; their locals are cleared, while the traceback lines are
    kept for error messages. Then the garbage collector runs and every present device cache is
    emptied.

    Args:
        exc: The exception the failed attempt raised, or ``None``.

    Example:
        >>> import torch
        >>> from elastic_batches.oom import release_memory
        >>> try:
        ...     raise torch.OutOfMemoryError("CUDA out of memory")
        ... except torch.OutOfMemoryError as err:
        ...     release_memory(err)
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
    gc.collect(1)  # the failed attempt's objects are young; a full collection can take 100s of ms
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        xpu.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()

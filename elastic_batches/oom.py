"""Recognising out-of-memory errors, the outcome of an attempt, and releasing what a failed attempt held.

OOM detection lives in this file only. ``torch.OutOfMemoryError`` is matched by type first;
backends that raise a plain ``RuntimeError`` are matched on their documented messages second.
Every other exception is left alone.
"""

from __future__ import annotations

import enum
import gc
import re
import traceback

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = [
    "ElasticOOMError",
    "Status",
    "clear_error",
    "is_nccl_oom",
    "is_oom_error",
    "release_memory",
    "requested_bytes",
    "status_of",
]


class ElasticOOMError(torch.OutOfMemoryError):
    """Out of memory where splitting cannot help: at the smallest microbatch, or outside the microbatches."""


class Status(enum.IntEnum):
    """The outcome of an attempt, or of any phase every rank votes on: the worst over ranks wins."""

    OK = 0
    OOM = 1
    ERROR = 2


# Messages of allocators and libraries that raise RuntimeError rather than torch.OutOfMemoryError.
_OOM_MESSAGES = (
    "CUDA out of memory",  # CUDA caching allocator (older torch raised RuntimeError)
    "CUDA error: out of memory",  # CUDA runtime / kernel launch
    "CUDA driver error: out of memory",  # CUDA driver API: the caching allocator's expandable segments map pages
    "HIP out of memory",  # ROCm caching allocator
    "hipErrorOutOfMemory",  # ROCm runtime
    "XPU out of memory",  # Intel GPU allocator
    "MPS backend out of memory",  # Apple MPS allocator
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS handle / workspace allocation
    "CUFFT_ALLOC_FAILED",  # cuFFT plan's work area
    "CUSOLVER_STATUS_ALLOC_FAILED",  # cuSOLVER handle / workspace
    "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",  # cuDNN workspace too large for free memory
    "Device out of memory",  # Habana HPU
    "PT_DEVMEM Allocation failed",  # Habana HPU device memory pool
)
# cuDNN 8's CUDNN_STATUS_ALLOC_FAILED and cuDNN 9's CUDNN_STATUS_INTERNAL_ERROR_{HOST,DEVICE}_ALLOCATION_FAILED.
_CUDNN_ALLOC = re.compile(r"CUDNN_STATUS_\w*ALLOC")
_NCCL_NOTE = (
    "elastic_batches: NCCL itself ran out of device memory; this is not retried, because a NCCL communicator "
    "that failed is not safe to use again. Free device memory for NCCL's buffers (a lower NCCL_BUFFSIZE, a "
    "smaller batch or model), then restart the process group, or the run from a checkpoint"
)


def is_nccl_oom(exc: BaseException) -> bool:
    """Tell whether an exception is NCCL's own out-of-memory (inside a collective or a communicator's set-up).

    Such an error is never taken for a retriable OOM (:func:`is_oom_error` is ``False``): the
    communicator that raised it is not safe to reuse. A ``torch.OutOfMemoryError`` raised while
    allocating a collective's output is the caching allocator's, and is an ordinary OOM.

    Example:
        >>> from elastic_batches.oom import is_nccl_oom
        >>> is_nccl_oom(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:3375, unhandled cuda error; "
        ...     "Last error: Cuda failure 'out of memory'"))
        True
        >>> is_nccl_oom(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:3375, remote process exited"))
        False
    """
    if not isinstance(exc, RuntimeError) or isinstance(exc, torch.OutOfMemoryError):
        return False
    message = str(exc)
    return "NCCL" in message and ("out of memory" in message or "Failed to CUDA calloc" in message)


def is_oom_error(exc: BaseException) -> bool:
    """Tell whether an exception means the device (or host) ran out of memory, so that a smaller microbatch may fit.

    Args:
        exc: Any exception.

    Returns:
        ``True`` for ``torch.OutOfMemoryError`` and for ``RuntimeError``s carrying one of the
        documented out-of-memory messages: of the CUDA caching allocator, runtime and driver
        API, HIP, XPU, MPS, the CPU allocator, cuBLAS, cuFFT, cuSOLVER and cuDNN allocations
        (every ``CUDNN_STATUS_*ALLOC*`` status) and HPU; ``False`` for everything else, NCCL's
        own out-of-memory included (:func:`is_nccl_oom`), and an illegal memory access, a launch
        failure or a library's execution failure.

    Example:
        >>> import torch
        >>> from elastic_batches import is_oom_error
        >>> is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
        True
        >>> is_oom_error(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
        True
        >>> is_oom_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
        False
        >>> is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
        False
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError) or is_nccl_oom(exc):  # torch.AcceleratorError subclasses RuntimeError
        return False
    message = str(exc)
    return any(pattern in message for pattern in _OOM_MESSAGES) or _CUDNN_ALLOC.search(message) is not None


_REQUEST = re.compile(r"Tried to allocate (\d+(?:\.\d+)?) (bytes|KiB|MiB|GiB|TiB)")
_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def requested_bytes(exc: BaseException | None) -> int | None:
    """The allocation an out-of-memory error says failed (``Tried to allocate 20.00 MiB``), in bytes; else ``None``.

    CUDA's caching allocator and ``elastic_batches.testing.MemoryBudget`` say it in the same words;
    the value is as precise as the message (two decimals of its unit).

    Example:
        >>> import torch
        >>> from elastic_batches.oom import requested_bytes
        >>> requested_bytes(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 MiB. GPU 0 has ..."))
        2621440
        >>> requested_bytes(RuntimeError("CUDA error: out of memory")) is None
        True
    """
    found = _REQUEST.search(str(exc)) if exc is not None and is_oom_error(exc) else None
    if found is None:
        return None
    return round(float(found.group(1)) * _UNITS[found.group(2)])


def status_of(exc: BaseException) -> Status:
    """``Status.OOM`` for an out-of-memory error (:func:`is_oom_error`), ``Status.ERROR`` for any other.

    NCCL's own out-of-memory (:func:`is_nccl_oom`) is an error, and gets a note that names the
    cause and why it is not retried (shown under its traceback).

    Example:
        >>> import torch
        >>> from elastic_batches.oom import status_of
        >>> status_of(torch.OutOfMemoryError("CUDA out of memory")).name, status_of(KeyError("x")).name
        ('OOM', 'ERROR')
    """
    if is_oom_error(exc):
        return Status.OOM
    if is_nccl_oom(exc) and _NCCL_NOTE not in getattr(exc, "__notes__", ()):
        _add_note(exc, _NCCL_NOTE)
    return Status.ERROR


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (Python 3.11), or its equivalent before."""
    exc.__notes__ = [*getattr(exc, "__notes__", ()), note]  # type: ignore[attr-defined]


def clear_error(exc: BaseException | None) -> None:
    """Break the references a caught error holds to the attempt that raised it.

    The frames of ``exc``'s traceback keep the failed microbatch's tensors (inputs,
    activations, partial losses) alive, and, through the locals that hold the attempt which
    holds the error, form a reference cycle: once a long microbatch made the collector promote
    them to its oldest generation, no young collection frees them. Every finished frame of the
    tracebacks of ``exc``, its causes and contexts is cleared (its locals dropped; the lines
    stay for error messages), so that what they held is freed as soon as the last reference
    to it goes, without the collector.

    Example:
        >>> import torch, weakref
        >>> from elastic_batches.oom import clear_error
        >>> def failing():
        ...     held = torch.ones(4)
        ...     raise torch.OutOfMemoryError(f"CUDA out of memory ({weakref.ref(held)})")
        >>> try:
        ...     failing()
        ... except torch.OutOfMemoryError as err:
        ...     error = err
        >>> clear_error(error)
        >>> error.__traceback__.tb_next.tb_frame.f_locals
        {}
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def release_memory(exc: BaseException | None = None) -> None:
    """Drop what a failed attempt still holds and hand cached device memory back.

    ``exc``'s frames are cleared first (:func:`clear_error`); then a young-generation collection
    frees what the attempt's own code left in cycles, and every present device cache is
    emptied: CUDA's, XPU's, MPS's, and that of every active
    :class:`~elastic_batches.memory.MemoryProbe` with a cache (an
    ``elastic_batches.testing.MemoryBudget`` simulating the caching allocator).

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
    clear_error(exc)
    del exc
    gc.collect(1)  # the failed attempt's objects are young; a full collection can take 100s of ms
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        xpu.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()
    for mode in _get_current_dispatch_mode_stack():
        empty_cache = getattr(mode, "empty_cache", None)
        if callable(empty_cache):
            empty_cache()

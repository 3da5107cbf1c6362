"""``AddressSpaceLimit``: a real CPU allocator out-of-memory error, from a limit on the process's address space.

``MemoryBudget`` simulates a device; this makes the real one refuse. Under
``resource.setrlimit(RLIMIT_AS, ...)`` the kernel refuses any mapping past the limit, and
torch's CPU allocator raises ``RuntimeError: ... DefaultCPUAllocator: can't allocate memory``,
which ``is_oom_error`` recognises: the batch is split and retried as after a device OOM.

The limit is on *address space*, not on memory in use, so three things are set up for it to
follow the tensors' bytes: glibc's malloc is told to map every block of 64 KiB or more on its
own (``M_MMAP_THRESHOLD``: such a block is unmapped when freed, instead of staying in a heap
whose top may never shrink), to keep a single arena (``M_ARENA_MAX``: each further arena
reserves 64 MiB of address space up front), and the limit is set relative to the address space
in use when it is entered. Keep torch at one thread (``torch.set_num_threads(1)``): each thread
reserves its stack. Linux only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import sys
from pathlib import Path
from types import TracebackType

from elastic_batches._state import is_int

__all__ = ["AddressSpaceLimit", "address_space_bytes"]

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameters (malloc.h)
_M_ARENA_MAX = -8
_MMAP_THRESHOLD = 64 * 1024
_MALLOC_READY = False


def address_space_bytes() -> int:
    """The process's address space in use now (``VmSize`` of ``/proc/self/status``), in bytes.

    Raises:
        OSError: not on Linux (no ``/proc/self/status``).

    Example:
        >>> from elastic_batches.testing import address_space_bytes
        >>> address_space_bytes() > 0
        True
    """
    status = Path("/proc/self/status")
    if not status.exists():
        raise OSError("address_space_bytes needs Linux (/proc/self/status); use MemoryBudget elsewhere")
    match = re.search(r"^VmSize:\s+(\d+) kB", status.read_text(), flags=re.MULTILINE)
    if match is None:  # pragma: no cover - every Linux kernel writes it
        raise OSError("/proc/self/status has no VmSize line")
    return int(match.group(1)) * 1024


def _prepare_malloc() -> None:
    """Map large blocks one by one and keep one arena, so that address space follows live bytes.

    Done from the start of the process (``AddressSpaceLimit.prepare()`` first thing), the address
    space in use holds no freed heap that a later allocation could reuse beyond the limit.
    """
    global _MALLOC_READY
    if _MALLOC_READY:
        return
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name or "libc.so.6")
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) or not mallopt(_M_ARENA_MAX, 1):
        raise OSError("AddressSpaceLimit needs glibc's malloc (mallopt); use MemoryBudget elsewhere")
    _MALLOC_READY = True


class AddressSpaceLimit:
    """Limit the process's address space to what it uses now plus ``extra_bytes``, so that the real allocator refuses.

    A context manager: entering it sets the soft ``RLIMIT_AS`` to the address space in use plus
    ``extra_bytes``; leaving it puts the previous limit back. Inside, an allocation that would pass
    the limit raises torch's own ``RuntimeError: ... DefaultCPUAllocator: can't allocate memory``.
    Train under it in a process of its own (a subprocess of the test), with torch at one thread,
    and leave headroom in ``extra_bytes`` for what Python allocates besides tensors (a few MiB).

    Args:
        extra_bytes: Address space allowed above what is in use at entry.
        configure_malloc: Set glibc's malloc up so that address space follows the live tensors
            (default ``True``; the setting lasts for the rest of the process, and makes every
            allocation of 64 KiB or more a mapping of its own). ``False`` leaves malloc as it is:
            the limit then holds, but freed memory may stay mapped.

    Attributes:
        limit_bytes: The limit set (address space at entry plus ``extra_bytes``), ``None`` outside.

    Raises:
        ValueError: ``extra_bytes`` is negative.
        OSError: not Linux with glibc.

    Example:
        >>> import torch
        >>> from elastic_batches import is_oom_error
        >>> from elastic_batches.testing import AddressSpaceLimit
        >>> with AddressSpaceLimit(extra_bytes=64 * 2**20, configure_malloc=False):
        ...     try:
        ...         torch.empty(256 * 2**20, dtype=torch.uint8)
        ...     except RuntimeError as err:
        ...         print(is_oom_error(err), "DefaultCPUAllocator: can't allocate memory" in str(err))
        True True
    """

    def __init__(self, extra_bytes: int, *, configure_malloc: bool = True) -> None:
        if not is_int(extra_bytes):
            raise TypeError(f"AddressSpaceLimit: extra_bytes must be an int (bytes), got {extra_bytes!r}")
        if extra_bytes < 0:
            raise ValueError(f"AddressSpaceLimit: extra_bytes must be >= 0, got {extra_bytes}")
        if sys.platform != "linux":
            raise OSError(f"AddressSpaceLimit needs Linux (RLIMIT_AS is not enforced on {sys.platform})")
        self.extra_bytes = extra_bytes
        self.configure_malloc = configure_malloc
        self.limit_bytes: int | None = None
        self._previous: tuple[int, int] | None = None

    @staticmethod
    def prepare() -> None:
        """Set glibc's malloc up for the limit now, before the process allocates much.

        Call it first thing in the process that will train under the limit: memory freed before
        the malloc setting may stay in the heap, counted in the baseline and reused past the
        limit. Entering the limit does it too (when ``configure_malloc``), but later.

        Raises:
            OSError: not glibc.
        """
        _prepare_malloc()

    def __enter__(self) -> AddressSpaceLimit:
        import resource

        if self.configure_malloc:
            _prepare_malloc()
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = address_space_bytes() + self.extra_bytes
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        self._previous = (soft, hard)
        self.limit_bytes = limit
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        import resource

        if self._previous is not None:
            resource.setrlimit(resource.RLIMIT_AS, self._previous)
        self._previous = None
        self.limit_bytes = None

    def __repr__(self) -> str:
        return f"AddressSpaceLimit(extra_bytes={self.extra_bytes}, limit_bytes={self.limit_bytes})"

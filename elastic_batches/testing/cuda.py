"""``StandInCuda``: the memory functions of ``torch.cuda``, on a CPU, over a caching-allocator ``MemoryBudget``.

Code written against ``torch.cuda``'s memory API (a probe, a benchmark that caps memory and
reads peaks) can run on a CPU against this object in place of the module: tensors live on the
CPU under a :class:`~elastic_batches.testing.MemoryBudget` with ``allocator="caching"`` (or
``"expandable"``), and each function checks its ``device`` argument as the real one does, so
that a call a GPU would refuse fails here too: ``set_per_process_memory_fraction``,
``get_per_process_memory_fraction`` and ``caching_allocator_alloc`` need a device with an index
(``torch.device("cuda")`` raises ``ValueError``), the statistics accept one without.
"""

from __future__ import annotations

from typing import Any

import torch

from elastic_batches.testing.memory import MemoryBudget

__all__ = ["StandInCuda"]


def _index(device: Any, *, optional: bool) -> int:
    """The device index as ``torch.cuda._get_device_index`` finds it: refused where the real function refuses it."""
    if device is None and optional:
        return 0
    if device is None:
        device = 0  # the real functions take the current device first
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device) and device.type == "cuda" and device.index is None:
        if optional:
            return 0
        raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
    if isinstance(device, torch.device) and device.type != "cuda":
        raise ValueError(f"Expected a cuda device, but got: {device}")
    index = device if isinstance(device, int) else device.index
    if index != 0:
        raise RuntimeError(f"CUDA error: invalid device ordinal (the stand-in has one device, got index {index})")
    return 0


class StandInCuda:
    """One simulated CUDA device: ``total_bytes`` of memory, a budget as its caching allocator.

    Args:
        total_bytes: The device's memory (``mem_get_info``'s total).
        allocator: ``"caching"`` (default) or ``"expandable"`` (``expandable_segments:True``).

    Attributes:
        budget: The :class:`MemoryBudget` whose limit is the per-process fraction of
            ``total_bytes`` less :attr:`other_process_bytes`; enter it (``with cuda.budget:``)
            around the code that allocates.
        other_process_bytes: Bytes another process holds on the device (less free memory).

    Example:
        >>> import torch
        >>> from elastic_batches.testing import StandInCuda
        >>> cuda = StandInCuda(64 << 20)
        >>> cuda.set_per_process_memory_fraction(0.5, torch.device("cuda", 0))
        >>> with cuda.budget:
        ...     x = torch.empty(1 << 20)  # 4 MiB: a 20 MiB segment
        >>> cuda.memory_allocated(), cuda.memory_reserved() >> 20, cuda.get_per_process_memory_fraction(0)
        (4194304, 20, 0.5)
        >>> try:
        ...     cuda.set_per_process_memory_fraction(0.5, torch.device("cuda"))
        ... except ValueError as err:
        ...     print(err)
        Expected a torch.device with a specified index or an integer, but got:cuda
    """

    def __init__(self, total_bytes: int, *, allocator: str = "caching") -> None:
        if allocator not in ("caching", "expandable"):
            raise ValueError(f"StandInCuda: allocator must be 'caching' or 'expandable', got {allocator!r}")
        self.total_bytes = int(total_bytes)
        self.budget = MemoryBudget(self.total_bytes, allocator=allocator)
        self.other_process_bytes = 0
        self._fraction = 1.0
        self._blocks: dict[int, torch.Tensor] = {}

    def _update_limit(self) -> None:
        self.budget.limit_bytes = max(0, int(self.total_bytes * self._fraction) - self.other_process_bytes)

    def take_by_another_process(self, nbytes: int) -> None:
        """Let another process hold ``nbytes`` of the device from now on (0: it let go)."""
        self.other_process_bytes = int(nbytes)
        self._update_limit()

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def synchronize(self, device: Any = None) -> None:
        _index(device, optional=True)

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        _index(device, optional=False)
        if not isinstance(fraction, float) or not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self._fraction = fraction
        self._update_limit()

    def get_per_process_memory_fraction(self, device: Any = None) -> float:
        _index(device, optional=False)
        return self._fraction

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        _index(device, optional=True)
        used = self.budget.reserved_bytes + self.other_process_bytes
        return max(0, self.total_bytes - used), self.total_bytes

    def memory_allocated(self, device: Any = None) -> int:
        _index(device, optional=True)
        return self.budget.live_bytes

    def max_memory_allocated(self, device: Any = None) -> int:
        _index(device, optional=True)
        return self.budget.peak_bytes

    def memory_reserved(self, device: Any = None) -> int:
        _index(device, optional=True)
        return self.budget.reserved_bytes

    def max_memory_reserved(self, device: Any = None) -> int:
        _index(device, optional=True)
        return self.budget.peak_reserved_bytes

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        _index(device, optional=True)
        self.budget.reset_peak()

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        _index(device, optional=True)
        return {
            "allocated_bytes.all.current": self.budget.live_bytes,
            "allocated_bytes.all.peak": self.budget.peak_bytes,
            "reserved_bytes.all.current": self.budget.reserved_bytes,
            "reserved_bytes.all.peak": self.budget.peak_reserved_bytes,
            "num_ooms": self.budget.oom_count,
        }

    def empty_cache(self) -> None:
        self.budget.empty_cache()

    def caching_allocator_alloc(self, size: int, device: Any = None, stream: Any = None) -> int:
        _index(device, optional=False)
        with self.budget:
            block = torch.empty(int(size), dtype=torch.uint8)
        pointer = block.data_ptr()
        self._blocks[pointer] = block
        return pointer

    def caching_allocator_delete(self, mem_ptr: int) -> None:
        self._blocks.pop(mem_ptr, None)

"""``StandInCuda``: the memory functions of ``torch.cuda``, on a CPU, over a caching-allocator ``MemoryBudget``.

Code written against ``torch.cuda``'s memory API (a probe, a benchmark that caps memory and
reads peaks) can run on a CPU against this object in place of the module: tensors live on the
CPU under a :class:`~elastic_batches.testing.MemoryBudget` with ``allocator="caching"`` (or
``"expandable"``), and each function checks its ``device`` argument as the real one does, so
that a call a GPU would refuse fails here too: ``set_per_process_memory_fraction``,
``get_per_process_memory_fraction`` and ``caching_allocator_alloc`` need a device with an index
(``torch.device("cuda")`` raises ``ValueError``), the statistics accept one without, and an index
past ``device_count`` raises ``invalid device ordinal``. With ``device_count=2`` it stands for a
model spread over two devices in one process: each device has its own budget and its own
default random generator (``get_rng_state`` / ``set_rng_state``, and :meth:`StandInCuda.generator`
to draw from it, as a dropout on that device would).
"""

from __future__ import annotations

from typing import Any

import torch

from elastic_batches.testing.memory import MemoryBudget

__all__ = ["StandInCuda"]


def _index(device: Any, *, optional: bool, count: int = 1) -> int:
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
    if not 0 <= index < count:
        raise RuntimeError(
            f"CUDA error: invalid device ordinal (the stand-in has {count} device(s), got index {index})"
        )
    return index


class StandInCuda:
    """Simulated CUDA devices: ``total_bytes`` of memory each, a budget as each one's caching allocator.

    Args:
        total_bytes: Each device's memory (``mem_get_info``'s total).
        allocator: ``"caching"`` (default) or ``"expandable"`` (``expandable_segments:True``).
        device_count: How many devices (``cuda:0`` ... ``cuda:{device_count - 1}``).

    Attributes:
        budgets: Per device, the :class:`MemoryBudget` whose limit is what the caching allocator
            may reserve there: its per-process fraction of ``total_bytes``, or what another
            process left of the device, whichever is less (as on CUDA, another process takes
            the device's free memory, not this process's fraction); enter one
            (``with cuda.budgets[1]:``) around the code that allocates on that device.
        budget: ``budgets[0]``, the current device's.
        other_process_bytes: Bytes another process holds on device 0 (less free memory).

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
        >>> two = StandInCuda(64 << 20, device_count=2)
        >>> state = two.get_rng_state("cuda:1")
        >>> first = torch.rand(2, generator=two.generator(1))
        >>> two.set_rng_state(state, torch.device("cuda", 1))
        >>> torch.equal(first, torch.rand(2, generator=two.generator(1)))
        True
    """

    def __init__(self, total_bytes: int, *, allocator: str = "caching", device_count: int = 1) -> None:
        if allocator not in ("caching", "expandable"):
            raise ValueError(f"StandInCuda: allocator must be 'caching' or 'expandable', got {allocator!r}")
        if device_count < 1:
            raise ValueError(f"StandInCuda: device_count must be at least 1, got {device_count}")
        self.total_bytes = int(total_bytes)
        self.budgets = [MemoryBudget(self.total_bytes, allocator=allocator) for _ in range(device_count)]
        self.budget = self.budgets[0]
        self._other = [0] * device_count
        self._fractions = [1.0] * device_count
        self._generators = [torch.Generator().manual_seed(index) for index in range(device_count)]
        self._blocks: dict[int, tuple[int, torch.Tensor]] = {}

    def _at(self, device: Any, *, optional: bool = True) -> int:
        return _index(device, optional=optional, count=len(self.budgets))

    @property
    def other_process_bytes(self) -> int:
        return self._other[0]

    def _update_limit(self, index: int) -> None:
        # what the caching allocator may reserve: its fraction of the device, and no more than the others left free
        limit = min(int(self.total_bytes * self._fractions[index]), self.total_bytes - self._other[index])
        self.budgets[index].limit_bytes = max(0, limit)

    def take_by_another_process(self, nbytes: int, device: Any = 0) -> None:
        """Let another process hold ``nbytes`` of ``device`` from now on (0: it let go).

        Example:
            >>> from elastic_batches.testing import StandInCuda
            >>> cuda = StandInCuda(64 << 20)
            >>> cuda.set_per_process_memory_fraction(0.5, 0)  # 32 MiB for this process
            >>> cuda.take_by_another_process(16 << 20)  # 48 MiB free: the fraction still limits
            >>> cuda.budget.limit_bytes >> 20, cuda.mem_get_info()[0] >> 20
            (32, 48)
            >>> cuda.take_by_another_process(40 << 20)  # 24 MiB free: less than the fraction
            >>> cuda.budget.limit_bytes >> 20
            24
        """
        index = self._at(device)
        self._other[index] = int(nbytes)
        self._update_limit(index)

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return len(self.budgets)

    def current_device(self) -> int:
        return 0

    def synchronize(self, device: Any = None) -> None:
        self._at(device)

    def generator(self, device: Any = None) -> torch.Generator:
        """The default random generator of ``device`` (what ``torch.cuda``'s random functions on it draw from)."""
        return self._generators[self._at(device)]

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self._generators[self._at(device)].get_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "cuda") -> None:
        self._generators[self._at(device)].set_state(new_state)

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        index = self._at(device, optional=False)
        if not isinstance(fraction, float) or not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self._fractions[index] = fraction
        self._update_limit(index)

    def get_per_process_memory_fraction(self, device: Any = None) -> float:
        return self._fractions[self._at(device, optional=False)]

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        index = self._at(device)
        used = self.budgets[index].reserved_bytes + self._other[index]
        return max(0, self.total_bytes - used), self.total_bytes

    def memory_allocated(self, device: Any = None) -> int:
        return self.budgets[self._at(device)].live_bytes

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.budgets[self._at(device)].peak_bytes

    def memory_reserved(self, device: Any = None) -> int:
        return self.budgets[self._at(device)].reserved_bytes

    def max_memory_reserved(self, device: Any = None) -> int:
        return self.budgets[self._at(device)].peak_reserved_bytes

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.budgets[self._at(device)].reset_peak()

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        budget = self.budgets[self._at(device)]
        return {
            "allocated_bytes.all.current": budget.live_bytes,
            "allocated_bytes.all.peak": budget.peak_bytes,
            "reserved_bytes.all.current": budget.reserved_bytes,
            "reserved_bytes.all.peak": budget.peak_reserved_bytes,
            "num_ooms": budget.oom_count,
        }

    def empty_cache(self) -> None:
        for budget in self.budgets:
            budget.empty_cache()

    def caching_allocator_alloc(self, size: int, device: Any = None, stream: Any = None) -> int:
        index = self._at(device, optional=False)
        with self.budgets[index]:
            block = torch.empty(int(size), dtype=torch.uint8)
        pointer = block.data_ptr()
        self._blocks[pointer] = (index, block)
        return pointer

    def caching_allocator_delete(self, mem_ptr: int) -> None:
        self._blocks.pop(mem_ptr, None)

"""What memory says when a batch cannot run even at its smallest microbatch: the note of that ``ElasticOOMError``.

"Does not fit at one row" leaves a newcomer guessing; a probe can tell more. The
:class:`Shortfall` holds what it read: the bytes in use before the step began (the model, its
gradients and optimizer state, whatever else the loop keeps alive), the bytes in use when the
smallest microbatch ran out, and the allocation that failed (the ``Tried to allocate ...`` of
CUDA's and ``MemoryBudget``'s messages). Its :meth:`~Shortfall.note` says how much of the device
was taken before the step and by how much the smallest microbatch exceeded what was left.
"""

from __future__ import annotations

import dataclasses

from elastic_batches.memory.model import format_bytes
from elastic_batches.memory.probe import MemoryReading

__all__ = ["Shortfall"]


@dataclasses.dataclass(frozen=True, slots=True)
class Shortfall:
    """The memory of a step whose smallest microbatch ran out, as a probe read it (bytes).

    Attributes:
        probe: What read it (the probe's class name).
        before: In use, and the capacity, before the step's first attempt.
        held: In use when the smallest microbatch ran out, or ``None`` (not known: another
            rank's OOM, or the probe could not be read).
        requested: The allocation that failed, or ``None`` (the error did not say).

    Example:
        >>> from elastic_batches.memory import MemoryReading
        >>> from elastic_batches.memory.shortfall import Shortfall
        >>> print(Shortfall("MemoryBudget", MemoryReading(3 << 20, 4 << 20), (3 << 20) + (512 << 10), 1 << 20)
        ...       .note(1, "rows"))  # doctest: +NORMALIZE_WHITESPACE
        MemoryBudget: 3.00 MiB of 4.00 MiB were in use before the step began (75%: the model, its gradients and
        optimizer state, and whatever else was kept alive before the step), leaving 1.00 MiB; the microbatch of
        1 row held 512.00 KiB more when an allocation of 1.00 MiB failed: it needs at least 1.50 MiB, 512.00 KiB
        more than was left. No split makes that smaller: free memory held before the step (a smaller model or
        optimizer state, no tensors kept from earlier steps), or use a device with more
    """

    probe: str
    before: MemoryReading
    held: int | None
    requested: int | None

    def note(self, size: int, unit: str) -> str:
        """The sentences the error adds, for a smallest microbatch of ``size`` rows (or tokens, ``unit``)."""
        before, capacity = self.before.in_use, self.before.capacity
        what = f"{size} {'row' if unit == 'rows' else 'token'}{'' if size == 1 else 's'}"
        if capacity is None:
            text = f"{self.probe}: {format_bytes(before)} were in use before the step began"
        else:
            share = f"{100 * before / capacity:.0f}%" if capacity else "all"
            text = (
                f"{self.probe}: {format_bytes(before)} of {format_bytes(capacity)} were in use before the step began "
                f"({share}: the model, its gradients and optimizer state, and whatever else was kept alive before "
                f"the step), leaving {format_bytes(max(capacity - before, 0))}"
            )
        if self.held is None or self.requested is None:
            return text + (
                f"; the microbatch of {what} ran out of memory. No split makes what was in use before the step "
                "smaller: free some of it, or use a device with more"
            )
        grown = max(self.held - before, 0)
        need = grown + self.requested
        text += (
            f"; the microbatch of {what} held {format_bytes(grown)} more when an allocation of "
            f"{format_bytes(self.requested)} failed: it needs at least {format_bytes(need)}"
        )
        if capacity is not None:
            text += f", {format_bytes(max(need - max(capacity - before, 0), 0))} more than was left"
        return text + (
            ". No split makes that smaller: free memory held before the step (a smaller model or optimizer state, "
            "no tensors kept from earlier steps), or use a device with more"
        )

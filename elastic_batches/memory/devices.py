"""``DevicesProbe``: one probe over the several devices of a model spread over them in one process.

A model placed with ``device_map="auto"`` or split by hand (manual model parallel) runs each
microbatch on several devices; it fits only where it fits on every one. The controller's memory
model is one line (bytes per microbatch size), so this probe reports one virtual device: the
capacity is the smallest device's, and the bytes in use are that capacity less the least room
left on any device (``capacity_d - in_use_d``, the minimum over devices). A microbatch then fits
the virtual device exactly when it fits every real one, and the peak of a window is the least
room during it. Where the tightest device changes with the microbatch size, the peaks follow
the larger of the devices' lines, which the model's growth beyond the sizes measured covers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from elastic_batches.memory.probe import MemoryProbe, MemoryReading, device_probe

__all__ = ["DevicesProbe", "devices_probe"]


class DevicesProbe(MemoryProbe):
    """The tightest of several devices' probes, as one device: what fits it fits every one.

    Args:
        probes: One probe per device (an :class:`~elastic_batches.memory.AcceleratorProbe` each).

    Raises:
        ValueError: ``probes`` is empty.

    Example:
        >>> from elastic_batches.memory import DevicesProbe, MemoryProbe, MemoryReading
        >>> class Fixed(MemoryProbe):
        ...     def __init__(self, in_use, capacity):
        ...         self.in_use, self.capacity = in_use, capacity
        ...     def memory_reading(self):
        ...         return MemoryReading(self.in_use, self.capacity)
        ...     def start_window(self):
        ...         return self.in_use
        ...     def window_peak(self):
        ...         return self.in_use + 100
        >>> probe = DevicesProbe([Fixed(300, 1000), Fixed(900, 2000)])  # 700 and 1100 bytes of room
        >>> probe.memory_reading()  # the smallest capacity, less the least room
        MemoryReading(in_use=300, capacity=1000)
        >>> probe.start_window(), probe.window_peak()
        (300, 400)
    """

    def __init__(self, probes: Sequence[MemoryProbe]) -> None:
        if not probes:
            raise ValueError("DevicesProbe needs at least one probe (one per device the model uses)")
        self.probes = list(probes)
        self._capacities: list[int | None] = [None] * len(self.probes)

    def __repr__(self) -> str:
        return f"DevicesProbe({self.probes!r})"

    def _virtual(self, in_use: Sequence[int]) -> int:
        """The virtual device's bytes in use, for these bytes in use per device (capacities last read)."""
        limited = [(c, u) for c, u in zip(self._capacities, in_use, strict=True) if c is not None]
        if not limited:
            return max(in_use)  # nothing limits any device: the largest use, nothing to plan under
        smallest = min(c for c, _ in limited)
        return smallest - min(c - u for c, u in limited)

    def memory_reading(self) -> MemoryReading:
        readings = [probe.memory_reading() for probe in self.probes]
        self._capacities = [reading.capacity for reading in readings]
        limited = [c for c in self._capacities if c is not None]
        return MemoryReading(self._virtual([r.in_use for r in readings]), min(limited) if limited else None)

    def start_window(self) -> int:
        before = [probe.start_window() for probe in self.probes]
        self._capacities = [probe.memory_reading().capacity for probe in self.probes]
        return self._virtual(before)

    def window_peak(self) -> int:
        return self._virtual([probe.window_peak() for probe in self.probes])

    def finish(self) -> None:
        for probe in self.probes:
            probe.finish()


def devices_probe(devices: Sequence[torch.device]) -> MemoryProbe | None:
    """The probe of the accelerators among ``devices``: one device's, a :class:`DevicesProbe` of several, or ``None``.

    Example:
        >>> import torch
        >>> from elastic_batches.memory import devices_probe
        >>> devices_probe([torch.device("cpu")]) is None  # no accelerator: no probe
        True
    """
    probes = [probe for probe in (device_probe(d) for d in dict.fromkeys(devices)) if probe is not None]
    if not probes:
        return None
    return probes[0] if len(probes) == 1 else DevicesProbe(probes)

"""Device memory probes: the memory in use, the peak around a microbatch, and the capacity of this process.

A :class:`MemoryProbe` is what the controller's memory model learns from
(:class:`elastic_batches.memory.MemoryModel`). :class:`ElasticStep` reads one around each
microbatch of ``backward``: the bytes in use before it, the peak during it, and, once an attempt,
the capacity. Probes exist for

- CUDA and XPU (:class:`AcceleratorProbe`, from ``torch.cuda`` / ``torch.xpu``): in use is
  ``memory_allocated``, the peak ``max_memory_allocated`` after ``reset_peak_memory_stats``, and
  the capacity what the caching allocator may still reach: the bytes it reserved plus the device's
  free bytes (``mem_get_info``), at most the limit set by ``set_per_process_memory_fraction``, in
  whole 2 MiB (its segments' grain);
- ``elastic_batches.testing.MemoryBudget`` (simulated device memory on a CPU): its live bytes, a
  peak window, and ``limit_bytes`` (with a caching allocator in whole 2 MiB, as on CUDA).

MPS has no peak statistic in torch (``torch.mps`` reports the current allocation only), so it
gets no probe, like the CPU. Where the device has no probe, ``memory="auto"`` measures with the
:class:`MemoryProbe` active as a dispatch mode (:func:`active_probe`: inside
``with MemoryBudget(...):``), so a script run on a CPU under a budget predicts as it will on a
GPU; where there is none either, the controller's OOM-driven search runs as it always did.
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = [
    "SEGMENT_GRAIN",
    "AcceleratorProbe",
    "MemoryProbe",
    "MemoryReading",
    "active_probe",
    "check_memory",
    "device_probe",
]

SEGMENT_GRAIN = 2 << 20  # a caching allocator's segments are whole multiples of 2 MiB: it reserves no less


class MemoryReading(NamedTuple):
    """Memory of this process at one moment, in bytes.

    Attributes:
        in_use: Bytes allocated now.
        capacity: Bytes this process may allocate in all (what is in use included); ``None``
            when nothing limits it (a ``MemoryBudget`` without a limit): nothing can be predicted.

    Example:
        >>> from elastic_batches.memory import MemoryReading
        >>> reading = MemoryReading(in_use=3 << 20, capacity=8 << 20)
        >>> reading.capacity - reading.in_use
        5242880
    """

    in_use: int
    capacity: int | None


class MemoryProbe(abc.ABC):
    """Reports the memory of one device: in use, the peak of a window, the capacity.

    Implement it for a device torch has no probe for, and pass it as
    ``ElasticStep(model, memory=probe)``. Every method is called between microbatches, never
    inside one, on the rank that owns the device.

    Example:
        >>> from elastic_batches.memory import MemoryProbe, MemoryReading
        >>> class Fixed(MemoryProbe):  # a device with 1 MiB, of which 256 KiB are in use
        ...     def memory_reading(self) -> MemoryReading:
        ...         return MemoryReading(256 << 10, 1 << 20)
        ...     def start_window(self) -> int:
        ...         return 256 << 10
        ...     def window_peak(self) -> int:
        ...         return 512 << 10
        >>> probe = Fixed()
        >>> probe.start_window(), probe.window_peak() - (256 << 10)
        (262144, 262144)
    """

    @abc.abstractmethod
    def memory_reading(self) -> MemoryReading:
        """The bytes in use now and the capacity."""

    @abc.abstractmethod
    def start_window(self) -> int:
        """Start a new peak window (the peak becomes what is in use now); the bytes in use now."""

    @abc.abstractmethod
    def window_peak(self) -> int:
        """The highest bytes in use since :meth:`start_window`."""

    def finish(self) -> None:  # noqa: B027 (a hook with nothing to do by default)
        """The step's windows are over: leave the device's own statistics as the user would see them without them."""


def check_memory(owner: str, memory: object) -> None:
    """Refuse a ``memory=`` that is not ``"auto"``, ``None`` or a :class:`MemoryProbe`.

    Example:
        >>> from elastic_batches.memory import check_memory
        >>> try:
        ...     check_memory("ElasticStep", "cuda")
        ... except TypeError as err:
        ...     print(str(err)[:70])
        ElasticStep: memory must be 'auto', None or an elastic_batches.memory.
    """
    if memory is not None and memory != "auto" and not isinstance(memory, MemoryProbe):
        raise TypeError(
            f"{owner}: memory must be 'auto', None or an elastic_batches.memory.MemoryProbe (on a CPU: an "
            f"elastic_batches.testing.MemoryBudget), got {memory!r}"
        )


class AcceleratorProbe(MemoryProbe):
    """CUDA or XPU memory through ``torch.cuda`` / ``torch.xpu``.

    The capacity is what the caching allocator may still reach: what it reserved (memory cached
    for this process, free for its tensors though ``mem_get_info`` counts it as used) plus the
    device's free bytes, at most ``get_per_process_memory_fraction`` of the device, in whole 2 MiB
    (``SEGMENT_GRAIN``: every segment is a multiple of it, so the rest is never reserved). Memory other
    processes take shows as less free memory. Fragmentation of the cache is not visible here:
    the controller's margin is kept for it, and grows after an OOM the model did not predict.

    Starting a window resets the device's peak statistics (``reset_peak_memory_stats``), as
    measuring a peak per microbatch must; the peaks before the first window and every window's
    are kept, and :meth:`finish` (at the end of each step) puts the true maxima back, so that
    the user's own ``max_memory_allocated()`` and ``max_memory_reserved()`` (Lightning's
    ``DeviceStatsMonitor``, Hugging Face's memory tracker) report the highest since the user's
    last reset, as without the probe. The allocator's peaks are raised to them by blocks taken
    and given back at once (``caching_allocator_alloc``): the reserved peak first, by new
    segments of the missing bytes (a request of 10 MiB or more is a segment of its size, 1 MiB
    requests fill 2 MiB segments) that stay in the cache afterwards, as the user's peak had
    them; then the allocated one, by one more block. The reserved peak is raised only as far as
    the allocated peak allows (the blocks count as allocated) and the device's free memory
    holds, and a cached block that serves a request instead of a new segment leaves it lower;
    the allocated peak's last block may take a new segment where no cached block is that large
    (the reserved peak then ends above the user's by that segment). Exact on
    ``elastic_batches.testing.StandInCuda`` in ``tests/test_memory.py``; on a GPU,
    ``benchmarks/gpu_check.py`` reports both.

    Args:
        device: A ``cuda`` or ``xpu`` device.
        module: The device module (``torch.cuda`` or ``torch.xpu`` by default); a stand-in
            such as ``elastic_batches.testing.StandInCuda`` to run on a CPU.

    Raises:
        ValueError: the device is of another type, or its backend is not available.

    Example:
        >>> import torch
        >>> from elastic_batches.memory import AcceleratorProbe
        >>> try:
        ...     AcceleratorProbe(torch.device("cpu"))
        ... except ValueError as err:
        ...     print(str(err).split(":")[0])
        AcceleratorProbe measures cuda or xpu memory, not cpu
    """

    def __init__(self, device: torch.device | str, *, module: Any = None) -> None:
        device = torch.device(device)
        if device.type not in ("cuda", "xpu"):
            raise ValueError(
                f"AcceleratorProbe measures cuda or xpu memory, not {device.type}: use device_probe(device), which "
                "gives None where torch has no memory statistics"
            )
        if module is None:
            module = getattr(torch, device.type)
        if not module.is_available():
            raise ValueError(f"AcceleratorProbe: torch.{device.type} is not available in this process")
        if device.index is None:
            device = torch.device(device.type, module.current_device())
        self.device = device
        self._module = module
        self._user_peak: int | None = None  # the allocated peak since the user's last reset, while windows are open
        self._user_reserved = 0  # the reserved peak since the user's last reset, likewise

    def __repr__(self) -> str:
        return f"AcceleratorProbe({str(self.device)!r})"

    def memory_reading(self) -> MemoryReading:
        module, device = self._module, self.device
        free, total = module.mem_get_info(device)
        capacity = min(int(total * self._fraction()), int(module.memory_reserved(device)) + int(free))
        return MemoryReading(int(module.memory_allocated(device)), capacity - capacity % SEGMENT_GRAIN)

    def start_window(self) -> int:
        module, device = self._module, self.device
        peak = int(module.max_memory_allocated(device))  # the user's peak, then the last window's
        reserved = int(module.max_memory_reserved(device))
        first = self._user_peak is None
        self._user_peak = peak if self._user_peak is None else max(self._user_peak, peak)
        self._user_reserved = reserved if first else max(self._user_reserved, reserved)
        module.reset_peak_memory_stats(device)
        return int(module.memory_allocated(device))

    def finish(self) -> None:
        """Raise the allocator's peaks back to the highest reserved and allocated bytes since the user's last reset."""
        if self._user_peak is None:
            return
        module, device = self._module, self.device
        peak, self._user_peak = self._user_peak, None
        if not hasattr(module, "caching_allocator_alloc"):
            return
        allocated = int(module.memory_allocated(device))
        held: list[int] = []
        try:
            missing = self._user_reserved - int(module.max_memory_reserved(device))
            room = min(peak - allocated, self._free(), missing)  # the blocks count as allocated, and need new memory
            if missing > 0 and room >= 2 << 20:
                room -= room % SEGMENT_GRAIN
                requests = [room] if room >= 10 << 20 else [1 << 20] * (room >> 20)
                held += [module.caching_allocator_alloc(size, device) for size in requests]
            missing = peak - int(module.memory_allocated(device))
            if missing > 0 and peak > int(module.max_memory_allocated(device)):
                # allocated bytes are multiples of 512, as the allocator rounds: the peak becomes exactly `peak`. Under
                # 10 MiB with room for new 2 MiB segments, in requests of at most 1 MiB (the small pool's cached
                # blocks serve them, where one request would take a 20 MiB segment); else one, served from the cache
                small = missing < 10 << 20 and self._free() >= missing + (2 << 20)
                sizes = [min(1 << 20, missing - at) for at in range(0, missing, 1 << 20)] if small else [missing]
                held += [module.caching_allocator_alloc(size, device) for size in sizes]
        except RuntimeError:  # no cached block that large, and no room for one: leave the peak lower
            pass
        finally:
            for pointer in held:
                module.caching_allocator_delete(pointer)

    def _free(self) -> int:
        """The bytes the allocator may still reserve: the device's free memory, within the per-process fraction."""
        module, device = self._module, self.device
        free, total = module.mem_get_info(device)
        return max(0, min(int(free), int(total * self._fraction()) - int(module.memory_reserved(device))))

    def _fraction(self) -> float:
        """The per-process memory fraction set on the device (1.0 where the module has none)."""
        get = getattr(self._module, "get_per_process_memory_fraction", None)
        return 1.0 if get is None else float(get(self.device))

    def window_peak(self) -> int:
        return int(self._module.max_memory_allocated(self.device))


def active_probe() -> MemoryProbe | None:
    """The innermost :class:`MemoryProbe` active as a dispatch mode (``with MemoryBudget(...):``), or ``None``.

    ``ElasticStep(memory="auto")`` measures with it where the device has no probe of its own (a
    CPU), so a script run under a budget predicts exactly as it will on a GPU.

    Example:
        >>> from elastic_batches.memory import active_probe
        >>> from elastic_batches.testing import MemoryBudget
        >>> with MemoryBudget(limit_bytes=1 << 20) as budget:
        ...     active_probe() is budget
        True
        >>> active_probe() is None
        True
    """
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, MemoryProbe):
            return mode
    return None


def device_probe(device: torch.device | str | None) -> MemoryProbe | None:
    """The probe of ``device``: an :class:`AcceleratorProbe` for CUDA and XPU, ``None`` elsewhere (CPU, MPS, meta).

    Example:
        >>> from elastic_batches.memory import device_probe
        >>> device_probe("cpu") is None
        True
    """
    if device is None:
        return None
    device = torch.device(device)
    module = getattr(torch, device.type, None) if device.type in ("cuda", "xpu") else None
    if module is None or not module.is_available():
        return None
    return AcceleratorProbe(device)

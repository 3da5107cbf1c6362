"""What ``ElasticStep`` measures around the microbatches of an attempt.

A :class:`Meter` reads the step's memory probe around each microbatch of one ``backward``
attempt (the cut of the microbatch included) and feeds the controller's memory model: the
increment of each microbatch over what was in use before it, what the attempt retained from its
first microbatch, and, after an OOM, the microbatch that failed and what was free for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastic_batches.memory.model import MemoryModel
from elastic_batches.memory.probe import MemoryProbe, MemoryReading


class Meter:
    """One attempt's memory: a window around each microbatch, fed to ``model``.

    A probe that raises stops the measuring of the attempt (the model learns nothing more from
    it) instead of failing it: the step then cuts what is left without the model.

    Args:
        probe: The device's probe.
        model: The controller's memory model.
        start: The reading when the attempt started (its capacity is known).
        measuring: The attempt measures (its pieces' sizes follow the model as it learns).
    """

    def __init__(self, probe: MemoryProbe, model: MemoryModel, start: MemoryReading, *, measuring: bool) -> None:
        assert start.capacity is not None
        self.probe, self.model = probe, model
        self.measuring = measuring  # its failures move up at the model's narrowings, not kept
        self.start = start.in_use
        self.capacity = start.capacity
        self.index = 0  # microbatches measured so far
        self.retained = 0  # the most the attempt held between its microbatches, over its start
        self.size: int | None = None  # the size of the microbatch whose window is open
        self.before = 0  # bytes in use when that window opened
        self.forward: int | None = None  # bytes it held over that when its forward ended
        self.error: Exception | None = None  # what the probe raised; nothing is measured after it

    def _read(self, read: Callable[[], Any]) -> Any:
        """``read()`` of the probe, or ``None`` once the probe raised (the error is kept)."""
        if self.error is not None:
            return None
        try:
            return read()
        except Exception as err:  # a probe's failure is not the attempt's
            self.error = err
            self.size = None
            return None

    def reading_now(self) -> MemoryReading | None:
        """The probe's reading now, ``None`` once it raised."""
        return self._read(self.probe.memory_reading)

    def begin(self, size: int) -> None:
        """Open the window of the next microbatch, of ``size`` in the controller's unit (before it is cut)."""
        before = self._read(self.probe.start_window)
        if before is None:
            return
        if self.index >= 1:  # what the attempt holds between microbatches: the gradients, the pieces cut, losses
            self.retained = max(self.retained, before - self.start)
            self.model.observe_retained(self.retained)
        self.size, self.before, self.forward = size, before, None

    def forward_done(self) -> None:
        """The microbatch's forward returned its loss: what it holds now is what backward will need to free."""
        reading = self.reading_now()
        if reading is not None:
            self.forward = reading.in_use - self.before

    def end(self) -> None:
        """Close the window: the microbatch completed."""
        peak = self._read(self.probe.window_peak)
        if peak is None or self.size is None:
            return
        self.model.observe(self.size, peak - self.before, first=self.index == 0, forward=self.forward)
        self.size = None
        self.index += 1

    def skip(self) -> None:
        """Close the window of a microbatch that did not run (nothing counted in it)."""
        self.size = None

    def failed(self) -> None:
        """The attempt ran out of memory on this rank: the model learns the microbatch that failed, or none.

        (A peer's failure that stopped this rank at an FSDP2 collective is not this rank's, and
        teaches nothing of its memory: the step does not report it.)
        """
        reading = self.reading_now()
        if reading is None:
            return
        if reading.capacity is not None:
            self.capacity = reading.capacity
        if self.size is None:  # between microbatches (counting, summing, the gradient sync's buffers)
            if self.model.ready:
                self.model.widen("an OOM outside the microbatches, where it predicts nothing")
            return
        free = self.capacity - self.before
        self.model.observe_failure(self.size, free, first=self.index == 0, measuring=self.measuring)

    def reading(self) -> MemoryReading:
        """What the next attempt will likely start with: this one's start, the capacity last read."""
        return MemoryReading(self.start, self.capacity)

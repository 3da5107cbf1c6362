"""What ``ElasticStep`` measures around the microbatches of an attempt, and how it cuts a batch it measures.

A :class:`Meter` reads the step's memory probe around each microbatch of one ``backward``
attempt (the cut of the microbatch included) and feeds the controller's memory model: the
increment of each microbatch over what was in use before it, what the attempt retained from its
first microbatch, and, after an OOM, the microbatch that failed and what was free for it.
:func:`measured_pieces` cuts a batch the model knows nothing about: a small first microbatch, then
each next one from the rows left, at the size the model predicts from what was measured so far.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

from elastic_batches.balance import BatchLoad
from elastic_batches.batch import ElasticBatch, Microbatch
from elastic_batches.controller import SplitController
from elastic_batches.distributed.guard import PeerFailure
from elastic_batches.distributed.protocol import GradientSync
from elastic_batches.memory import MemoryProbe, MemoryReading
from elastic_batches.memory_model import SPREAD, MemoryModel
from elastic_batches.oom import is_oom_error

logger = logging.getLogger("elastic_batches.step")

_GROWTH = 2  # while measuring, a microbatch is at most this many times the largest before it


class Meter:
    """One attempt's memory: a window around each microbatch, fed to ``model``.

    A probe that raises stops the measuring of the attempt (the model learns nothing more from
    it) instead of failing it: the step then cuts what is left without the model.

    Args:
        probe: The device's probe.
        model: The controller's memory model.
        start: The reading when the attempt started (its capacity is known).
    """

    def __init__(self, probe: MemoryProbe, model: MemoryModel, start: MemoryReading) -> None:
        assert start.capacity is not None
        self.probe, self.model = probe, model
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

    def failed(self, error: BaseException) -> None:
        """The attempt raised ``error``: an OOM teaches the model (the microbatch that failed, or none).

        A peer's failure that stopped this rank at an FSDP2 collective teaches nothing of this rank's memory.
        """
        if not is_oom_error(error) or isinstance(error, PeerFailure):
            return
        reading = self.reading_now()
        if reading is None:
            return
        if reading.capacity is not None:
            self.capacity = reading.capacity
        if self.size is None:  # between microbatches (counting, summing, the gradient sync's buffers)
            if self.model.ready:
                self.model.widen("an OOM outside the microbatches, where it predicts nothing")
            return
        self.model.observe_failure(self.size, self.capacity - self.before, first=self.index == 0)

    def reading(self) -> MemoryReading:
        """What the next attempt will likely start with: this one's start, the capacity last read."""
        return MemoryReading(self.start, self.capacity)


def measured_pieces(
    batch: ElasticBatch,
    controller: SplitController,
    sync: GradientSync,
    meter: Meter,
    lead: int,
    smallest: int,
    count_fn: Callable[[Any], Any] | None,
    attempt: Any,
) -> Iterator[Microbatch]:
    """The microbatches of an attempt that measures: ``lead`` rows first, then each at the size predicted now.

    The second and third pieces give the model two sizes ``SPREAD`` apart (it plans only with a line
    whose slope was measured); no microbatch is more than twice the largest before it: where the
    peak per row grows at larger sizes (activations overtaking the gradients), the sizes measured
    so far under-estimate it. The limits hold over all of it: no piece has fewer than
    ``smallest`` rows (``min_microbatch_size``, the BatchNorm floor) and there are at most
    ``max_split_count`` pieces.

    Each microbatch is cut inside its window (``meter.begin``); the caller closes it. With
    ``count_fn``, the weights divide by its count over the whole batch, counted first; should the
    pieces' counts add up to another total, ``attempt.rescale`` says by how much the gradients
    must be scaled (where the ranks' microbatches are paired, FSDP2 per module, none: their
    gradients are reduced as they go, each weighed by the same total; the vote's totals correct
    it). ``sync`` agrees on each microbatch's count with the peers (:meth:`GradientSync.agree_pieces`).
    When the attempt ends, every microbatch gets the final ``count``.
    ``attempt.size`` is the largest piece cut so far, ``attempt.total`` the weight total.
    """
    rows = len(batch)
    load = batch.load(controller.unit)
    limit = controller.max_split_count
    estimate = 1.0
    if count_fn is not None:
        estimate = float(count_fn(batch.microbatch(0, rows).unwrap())) or 1.0
    sync.weigh(estimate if count_fn is not None else float(rows))
    made: list[Microbatch] = []
    counts: list[float] = []
    start, planned = 0, 3
    for index in itertools.count():
        if start >= rows:
            break
        left = rows - start
        room = max(1, left // smallest if limit is None else min(left // smallest, limit - index))
        if index == 0:
            take = lead
        else:
            rest = load.tail(start)
            count = _rest_count(controller, meter, rest, index, attempt.size)
            spread = math.ceil(SPREAD * len(made[-1]))
            if index == 2 and not meter.model.spread and not meter.model.failed_at(load.cost(start, start + spread)):
                count = min(count, -(-left // spread))  # a piece SPREAD times the last: the line's slope
            count = sync.agree_pieces(min(count, room), room)
            take, planned = rest.sizes(count, min_rows=smallest)[0], index + count
        take = max(take, smallest)
        if room == 1 or left - take < smallest:  # the last piece the limits allow, or too few rows left
            take = left
        stop = start + take
        size = load.cost(start, stop)
        attempt.size = max(attempt.size, size)
        meter.begin(size)
        mb = batch.microbatch(start, stop, index=index, count=index + 1 if stop == rows else max(planned, index + 2))
        if count_fn is not None:
            counts.append(float(count_fn(mb.unwrap())))
            mb = mb.reweighted(counts[-1] / estimate)
        made.append(mb)
        yield mb
        start = stop
    for mb in made:
        mb.count = len(made)
    attempt.sizes = [len(mb) for mb in made]
    attempt.total = math.fsum(counts) if count_fn is not None else float(rows)
    if count_fn is not None and attempt.total and attempt.total != estimate and not sync.pairs_microbatches:
        attempt.rescale = estimate / attempt.total  # count_fn did not add up over the pieces: weights by the real total
    logger.debug("measured attempt: %d microbatches of %s rows", len(made), [len(mb) for mb in made])


def _rest_count(controller: SplitController, meter: Meter, rest: BatchLoad, done: int, largest: int) -> int:
    """How many pieces the model cuts the rows left into now, none more than twice the largest before."""
    reading = meter.reading_now()
    if reading is None:  # the probe failed: no piece larger than the largest cut so far
        return rest.count_within(largest)
    return max(controller.plan_rest(rest, reading, done=done), rest.count_within(_GROWTH * largest))

"""``Plan``: how one attempt cuts a batch into microbatches, decided in one place.

:meth:`SplitController.plan_attempt` turns what the controller knows (the batch's load, the
limits, the memory model, the BatchNorm floor) into a :class:`Plan`; the ranks' agreement
(``GradientSync.agree_plan``) is the only thing that amends it, and returns a new one. A plan
either cuts the batch as its ``sizes`` say, or measures: a first microbatch of ``lead`` rows, then
each next one cut from the rows left, at the size the memory model predicts from what was
measured so far (:class:`Ramp`, whose rules live here too: the growth cap, the piece ``SPREAD``
times the last that gives the model its slope, the end piece absorbed, the limits).
"""

from __future__ import annotations

import dataclasses
import logging
import math

from elastic_batches.balance import BatchLoad
from elastic_batches.memory.model import SPREAD
from elastic_batches.memory.predictor import Predictor
from elastic_batches.memory.probe import MemoryReading
from elastic_batches.search import SizeSearch
from elastic_batches.settled import SettledSplit

__all__ = ["GROWTH", "Plan", "Ramp", "measuring_lead", "planned_count", "realized"]

logger = logging.getLogger("elastic_batches.controller")

GROWTH = 2  # while measuring, a microbatch is at most this many times the largest before it


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """How one attempt cuts a batch: its microbatches' rows, or a first, measuring microbatch.

    Attributes:
        load: The batch's load in the controller's unit.
        count: The microbatches planned (while measuring: a first guess, the ramp decides).
        lead: Rows of a first, measuring microbatch; 0: the batch is cut as ``sizes`` say.
        smallest: The fewest rows a microbatch may have (``min_microbatch_size``, the BatchNorm floor).
        max_split_count: The most microbatches allowed (``None``: no limit but the rows).
        sizes: The rows of each microbatch, in order (empty while measuring).

    Example:
        >>> from elastic_batches import BatchLoad
        >>> from elastic_batches.plan import Plan
        >>> plan = Plan.cut(BatchLoad(10), 4)
        >>> plan.sizes, plan.largest, plan.measuring
        ((3, 3, 2, 2), 3, False)
        >>> Plan.cut(BatchLoad(5), 3, smallest=2).sizes  # no piece under the floor
        (3, 2)
    """

    load: BatchLoad
    count: int
    lead: int = 0
    smallest: int = 1
    max_split_count: int | None = None
    sizes: tuple[int, ...] = ()

    @classmethod
    def cut(
        cls, load: BatchLoad, count: int, *, lead: int = 0, smallest: int = 1, max_split_count: int | None = None
    ) -> Plan:
        """The plan of ``count`` balanced pieces of at least ``smallest`` rows (none while measuring)."""
        sizes = () if lead else tuple(load.sizes(count, min_rows=smallest))
        return cls(load, count, lead, smallest, max_split_count, sizes)

    def amended(self, count: int, lead: int) -> Plan:
        """The plan the ranks agreed on: ``count`` pieces, or a measuring ``lead`` (the same limits)."""
        if (count, lead) == (self.count, self.lead):
            return self
        return Plan.cut(self.load, count, lead=lead, smallest=self.smallest, max_split_count=self.max_split_count)

    @property
    def measuring(self) -> bool:
        """Whether the first microbatch measures, and the rest is cut as it goes."""
        return bool(self.lead)

    @property
    def largest(self) -> int:
        """The cost of the largest piece in the unit (0 while measuring: not known before the cut)."""
        return self.load.largest(list(self.sizes)) if self.sizes else 0


def planned_count(
    load: BatchLoad,
    tag: int | None,
    memory: MemoryReading | None,
    settled: SettledSplit,
    search: SizeSearch,
    predictor: Predictor | None,
    retrying: int | None,
) -> int:
    """The count to try next on a batch (what :meth:`SplitController.plan` gives); may probe a larger microbatch.

    Predicting (a fitted memory model), the count is the fewest microbatches whose largest
    one's predicted peak keeps the margin free: the size agreed at the last vote, or the one
    ``memory`` allows now when that is smaller. After an OOM, until the next success, it is
    the more cautious of that and the search's count. Otherwise the settled count keeps to the
    search's capacity: while the search refines (a size fitted, a larger one failed, and they
    are more than 10% apart), it probes the count whose largest microbatch lies between them;
    with ``grow_after``, a growth probe is one microbatch fewer. A tag above the settled count is
    obeyed.

    ``retrying``: the smallest size that failed, while the batch is being retried: the count is
    raised until its largest piece (as the step cuts it, ``min_microbatch_size`` rows at least)
    is below it, or as fine as the limits allow, so that each retry cuts smaller and a call ends.
    """
    predicted = None if predictor is None else predictor.limit(memory)
    if predicted is None:
        count = search.count(load, settled, tag)
    else:
        count = load.count_within(predicted)
        if predictor is not None and predictor.fallback:
            count = max(count, search.count(load, settled, None))
        if tag is not None and tag > settled.unclamped(load):
            count = max(count, tag)
        count = settled.clamp(load.rows, count)
    if retrying is None:
        return count
    most = settled.clamp(load.rows, load.rows)
    while count < most and realized(load, count, settled.min_microbatch_size) >= retrying:
        count += 1
    return count


def realized(load: BatchLoad, count: int, min_rows: int) -> int:
    """The cost of the largest of ``count`` pieces as the step cuts them (``min_rows`` rows at least)."""
    return load.largest(load.sizes(count, min_rows=min_rows))


def measuring_lead(load: BatchLoad, predictor: Predictor | None, smallest: int, max_split_count: int | None) -> int:
    """Rows of a first, measuring microbatch for a batch the memory model cannot plan yet; 0: none.

    The next two pieces give the model two sizes ``SPREAD`` apart, which it needs to plan. A batch
    too small for those three pieces within the limits (``max_split_count`` below 3, fewer than
    about 3.5 times the smallest piece's rows) is not measured: the search plans it, and its
    microbatches are measured all the same.

    Example:
        >>> from elastic_batches import BatchLoad
        >>> from elastic_batches.memory import MemoryModel, Predictor
        >>> from elastic_batches.plan import measuring_lead
        >>> new = Predictor(MemoryModel())
        >>> measuring_lead(BatchLoad(256), new, 1, None), measuring_lead(BatchLoad(256), None, 1, None)
        (1, 0)
        >>> measuring_lead(BatchLoad(256), new, 1, 2), measuring_lead(BatchLoad(3), new, 1, None)
        (0, 0)
    """
    if predictor is None or not predictor.measures:
        return 0
    if max_split_count is not None and max_split_count < 3:
        return 0
    if load.rows < 2 * smallest + math.ceil(SPREAD * smallest):
        return 0
    logger.info(
        "measuring memory on a batch of %d rows: a first microbatch of %d row%s, the rest cut at the sizes "
        "it predicts (memory model: %s)",
        load.rows,
        smallest,
        "s" if smallest != 1 else "",
        predictor.model.describe(),
    )
    return smallest


def rest_count(predictor: Predictor, rest: BatchLoad, memory: MemoryReading, done: int, plan: Plan) -> int:
    """While measuring: the count for the rows left (``rest``), ``done`` microbatches run.

    The largest microbatch predicted to fit in what ``memory`` leaves free (the attempt's
    retained memory is in use already), within the limits.

    Example:
        >>> from elastic_batches import BatchLoad
        >>> from elastic_batches.memory import MemoryModel, MemoryReading, Predictor
        >>> from elastic_batches.plan import Plan, rest_count
        >>> model = MemoryModel()  # a first microbatch of 1 row, then one of 8 rows took 1800 bytes
        >>> model.observe(1, 1100, first=True); model.observe_retained(500)
        >>> model.observe(8, 1800, first=False)  # one size: 225 bytes per row, through the origin
        >>> plan = Plan.cut(BatchLoad(96), 1, lead=1)
        >>> memory = MemoryReading(in_use=500, capacity=5000)
        >>> rest_count(Predictor(model), BatchLoad(95), memory, 1, plan)  # 19 rows fit: 5 pieces
        5
    """
    count = rest.count_within(max(1, predictor.size(memory, started=True)))
    if plan.max_split_count is not None:
        count = min(count, max(1, plan.max_split_count - done))
    return max(1, min(count, rest.rows, max(1, rest.rows // plan.smallest)))


class Ramp:
    """The measuring cut of one attempt: each next piece from the rows left, at the size predicted now.

    The second and third pieces give the model two sizes ``SPREAD`` apart (it plans only with a
    line whose slope was measured); no microbatch is more than ``GROWTH`` times the largest before
    it (where the peak per row grows at larger sizes, the sizes measured so far under-estimate
    it). The limits hold over all of it: no piece has fewer than ``plan.smallest`` rows, there are
    at most ``plan.max_split_count`` pieces, and rows too few for a piece of their own join the
    last one.

    Example:
        >>> from elastic_batches import BatchLoad
        >>> from elastic_batches.memory import MemoryModel, Predictor
        >>> from elastic_batches.plan import Plan, Ramp
        >>> ramp = Ramp(Plan.cut(BatchLoad(10), 1, lead=1), Predictor(MemoryModel()))
        >>> ramp.room(0, 0), ramp.rows(0, ramp.plan.lead, ramp.room(0, 0)), ramp.rows(8, 1, 1)  # 2 rows left: the end
        (10, 1, 2)
    """

    def __init__(self, plan: Plan, predictor: Predictor) -> None:
        assert plan.measuring
        self.plan = plan
        self.predictor = predictor

    def room(self, start: int, index: int) -> int:
        """The most pieces the rows from ``start`` may still make, the ``index``-th next."""
        left = self.plan.load.rows - start
        limit = self.plan.max_split_count
        return max(1, left // self.plan.smallest if limit is None else min(left // self.plan.smallest, limit - index))

    def count(self, start: int, index: int, memory: MemoryReading | None, last: int, largest: int) -> int:
        """How many pieces this rank would cut the rows from ``start`` into now (before the ranks agree).

        ``last``: rows of the piece before; ``largest``: the cost of the largest piece so far;
        ``memory``: the reading now (``None``: the probe failed, no piece larger than ``largest``).
        """
        load = self.plan.load
        rest = load.tail(start)
        if memory is None:
            count = rest.count_within(largest)
        else:
            count = max(rest_count(self.predictor, rest, memory, index, self.plan), rest.count_within(GROWTH * largest))
        spread = math.ceil(SPREAD * last)
        model = self.predictor.model
        if index == 2 and not model.spread and not model.failed_at(load.cost(start, start + spread)):
            count = min(count, -(-(load.rows - start) // spread))  # a piece SPREAD times the last: the line's slope
        return min(count, self.room(start, index))

    def first_of(self, start: int, count: int) -> int:
        """Rows of the next piece when the rows from ``start`` are cut into ``count`` (agreed by the ranks)."""
        return self.plan.load.tail(start).sizes(count, min_rows=self.plan.smallest)[0]

    def rows(self, start: int, take: int, room: int) -> int:
        """The rows the next piece takes: ``take``, at least the floor, or all that is left at the end."""
        left = self.plan.load.rows - start
        take = max(take, self.plan.smallest)
        if room == 1 or left - take < self.plan.smallest:  # the last piece the limits allow, or too few rows left
            take = left
        return take

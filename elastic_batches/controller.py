"""``SplitController``: how many microbatches a batch is cut into, learned from OOMs.

The controller is the feedback channel between the loader (which tags batches with
``split_count``) and the step side (which reports each success and each OOM). It learns in
*microbatch sizes* (rows per microbatch), so that what it learned on one batch size applies to
another, and turns a size into the smallest count that respects it: ``ceil(rows / size)``.

The search:

1. An OOM at size ``s`` with no size known to fit halves: the next size is ``ceil(s / 2)``.
2. Once a size fits and a larger one failed, each following step probes the middle of the
   interval ``[fits, fails)``, until ``fits >= 0.9 * (fails - 1)``: the settled size is then at
   least 90% of the largest that fits, and it never OOMs again while memory stays as it is.
3. With ``grow_after=N``, after ``N`` steps without OOM it probes one microbatch fewer; an OOM
   there falls back to the settled count, and the batch is retried, not lost. Each failed probe
   doubles the wait before the next (up to ``64 N``); a probe that succeeds resets it to ``N``.
4. An OOM at a size that fitted before means memory shrank: what fitted is forgotten and the
   search halves again from there.

With ``unit="tokens"`` a size is a microbatch's *padded positions* (rows times its longest
sample) instead of its rows, and counts come from each batch's lengths (a :class:`BatchLoad`):
a batch of longer sequences gets more microbatches before it runs out of memory, and the
microbatches of one batch carry similar token counts.

Predicted (``margin``, on by default, and a step with a memory probe): the controller's
:class:`~elastic_batches.memory_model.MemoryModel` is fitted from the peaks measured around each
microbatch, and a plan keeps the largest microbatch's predicted peak under the capacity minus the
margin: no OOM is needed to find the count, nor to follow memory that shrinks or grows back. A
batch the model knows nothing about is measured first: its first microbatch is small, and the rest
is cut at the sizes it predicts. An OOM that still happens refits the model, widens the margin and
hands the retry of that batch to the search above (the more cautious of the two plans).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from elastic_batches._state import StateFields, check_state_dict, is_int
from elastic_batches.balance import BatchLoad, rows_within
from elastic_batches.memory import MemoryReading
from elastic_batches.memory_model import SPREAD as _SPREAD
from elastic_batches.memory_model import MemoryModel, check_margin
from elastic_batches.oom import ElasticOOMError

if TYPE_CHECKING:
    from elastic_batches.batch import ElasticBatch

__all__ = ["SettledSplit", "SplitController"]

logger = logging.getLogger(__name__)

_STATE_VERSION = 2
_STATE_KEYS_V1 = frozenset(
    {
        "version",
        "start_split_count",
        "fits",
        "fails",
        "last_rows",
        "last_lengths",
        "unit",
        "steps_since_oom",
        "grow_pending",
        "grow_wait",
        "oom_count",
        "retry_count",
        "discarded_microbatches",
    }
)
_STATE_KEYS = _STATE_KEYS_V1 | {"memory", "predicted", "fallback"}  # version 2: the memory model


def _positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not is_int(value) or value < 1:
        allowed = "an int >= 1 or None" if allow_none else "an int >= 1"
        raise ValueError(f"SplitController: {name} must be {allowed}, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class SettledSplit:
    """What a :class:`SplitController` has settled on at one moment: the count it gives any batch, without probing.

    A value: the controller makes a new one whenever it learns, so a batch tagged with one
    (:meth:`ElasticBatch.tag`) keeps the count of the moment it was tagged, worked out only when
    it is first read.

    Example:
        >>> from elastic_batches import SplitController
        >>> controller = SplitController()
        >>> controller.record_oom(size=64, load=64)
        >>> settled = controller.settled
        >>> settled.capacity, settled.count_for(64), settled.count_for(100)
        (32, 2, 4)
    """

    start_split_count: int
    capacity: int | None  # the largest microbatch a settled count keeps to; None: no OOM known, no limit
    min_microbatch_size: int
    max_split_count: int | None
    unit: str
    fits: int = 0  # the largest microbatch that fitted (0: none): without an OOM known, never more pieces than it needs
    source: object = dataclasses.field(default=None, compare=False, repr=False)  # the controller that settled it

    def count_for(self, load: int | BatchLoad) -> int:
        """The count for a batch of ``load`` rows (``unit="tokens"``: its ``BatchLoad``)."""
        if type(load) is int:  # the rows unit, without a BatchLoad to build
            rows = load
            return self.clamp(rows, self._count(lambda capacity: rows_within(rows, capacity)))
        assert isinstance(load, BatchLoad)
        return self.clamp(load.rows, self._count(load.count_within))

    def count_of(self, batch: ElasticBatch) -> int:
        """The count for ``batch``, read in this controller's unit (what a tag works out when first read)."""
        return self.count_for(len(batch) if self.unit == "rows" else batch.load(self.unit))

    def unclamped(self, load: BatchLoad) -> int:
        """The count that keeps to the capacity, before the limits."""
        return self._count(load.count_within)

    def _count(self, within: Callable[[int], int]) -> int:
        """The settled rule, given ``within(size)``: the fewest pieces of at most ``size``.

        Without an OOM known, nothing caps a microbatch: the starting count, or fewer pieces
        when a larger microbatch already fitted.
        """
        if self.capacity is not None:
            return within(self.capacity)
        if self.fits:
            return min(self.start_split_count, within(self.fits))
        return self.start_split_count

    def clamp(self, rows: int, count: int) -> int:
        """``count`` within the limits: at most ``rows``, ``max_split_count``, ``rows // min_microbatch_size``."""
        count = min(count, rows, max(1, rows // self.min_microbatch_size))
        if self.max_split_count is not None:
            count = min(count, self.max_split_count)
        return max(count, 1)


class SplitController:
    """Learns the split count that makes each batch fit, shared by the loader and the step.

    Args:
        split_count: The count to start with, before anything was learned.
        min_microbatch_size: Never cut microbatches smaller than this many rows; an OOM at this
            size raises :class:`ElasticOOMError`.
        max_split_count: Never cut a batch into more microbatches than this; an OOM at this count
            raises :class:`ElasticOOMError`. ``None``: no limit but the batch's rows.
        grow_after: After this many steps without an OOM, probe one microbatch fewer (memory may
            have grown: shorter sequences, freed buffers); the wait doubles after each failed
            probe, up to 64 times this. ``None`` (default): never probe.
        unit: What a microbatch size counts: ``"rows"`` (default), or ``"tokens"``, its padded
            positions (rows times its longest sample), for batches from a loader with
            ``pad_values``. With ``"tokens"``, pass each batch's ``batch.load("tokens")`` where a
            row count is asked for.
        margin: Predict microbatches from measured memory (where the step has a memory probe:
            CUDA, XPU, or ``ElasticStep(memory=MemoryBudget)``), keeping this fraction of the
            capacity free (a fraction in ``[0, 0.5]``). Until the model was wrong on this device it
            costs at most a twentieth of the microbatch predicted without it; after an OOM the
            model did not predict, it grows and applies whole. ``None``: no prediction, the
            OOM-driven search alone.

    Attributes:
        memory: The :class:`~elastic_batches.memory_model.MemoryModel` the step feeds (``None``
            with ``margin=None``).
        oom_count: OOMs reported, the final one of a failed step included.
        retry_count: Batches retried after an OOM.
        discarded_microbatches: Microbatches whose forward/backward work was thrown away because
            an OOM struck later in the same attempt (the failing one included).

    Example:
        >>> from elastic_batches import SplitController
        >>> controller = SplitController()
        >>> controller.plan(256)
        1
        >>> controller.record_oom(size=256, load=256, discarded=1)
        >>> controller.plan(256)
        2
        >>> controller.record_success(size=128, load=256)
        >>> controller.plan(256)  # probes between 128 (fits) and 256 (failed)
        2
        >>> controller.split_count, controller.microbatch_size
        (2, 128)
        >>> from elastic_batches import BatchLoad
        >>> tokens = SplitController(unit="tokens")
        >>> tokens.record_oom(size=1024, load=BatchLoad(16, [64] * 16))  # 16 x 64 did not fit
        >>> tokens.record_success(size=512, load=BatchLoad(16, [64] * 16))  # 8 x 64 fitted
        >>> tokens.count_for(BatchLoad(16, [128] * 16))  # 2x longer: 2x the microbatches
        4
    """

    def __init__(
        self,
        split_count: int = 1,
        *,
        min_microbatch_size: int = 1,
        max_split_count: int | None = None,
        grow_after: int | None = None,
        unit: str = "rows",
        margin: float | None = 0.05,
    ) -> None:
        if unit not in ("rows", "tokens"):
            raise ValueError(f"SplitController: unit must be 'rows' or 'tokens', got {unit!r}")
        _positive_int("split_count", split_count)
        _positive_int("min_microbatch_size", min_microbatch_size)
        _positive_int("max_split_count", max_split_count, allow_none=True)
        _positive_int("grow_after", grow_after, allow_none=True)
        if margin is not None:
            check_margin("SplitController", margin)
        if max_split_count is not None and split_count > max_split_count:
            raise ValueError(
                f"SplitController: split_count={split_count} exceeds max_split_count={max_split_count}; "
                "lower split_count or raise max_split_count"
            )
        self._min_microbatch_size = min_microbatch_size
        self._max_split_count = max_split_count
        self.grow_after = grow_after
        self.unit = unit
        self._start_split_count = split_count
        self._fits = 0  # largest microbatch size (rows) that completed a step; 0: none yet
        self._fails: int | None = None  # smallest microbatch size that ran out of memory
        self.memory = None if margin is None else MemoryModel(margin, unit=unit)
        self._predicted: int | None = None  # the size the ranks' models agreed fits, at the last vote
        self._fallback = False  # an OOM since the last success: the search plans the retry too
        self._voted = False  # a vote told what the ranks predict (a rank that predicts nothing stops prediction)
        self._learn(0, None)
        self._last_rows: BatchLoad | None = None
        self._ran: tuple[int, int] | None = None  # the last batch that completed: its microbatches, its largest
        self._steps_since_oom = 0
        self._grow_pending = False
        self._grow_wait = grow_after  # steps to wait before the next growth probe; doubles after a failed one
        self._tried: list[int] = []  # sizes that failed on the current batch, for error messages
        self.oom_count = 0
        self.retry_count = 0
        self.discarded_microbatches = 0

    def __repr__(self) -> str:
        memory = "" if self.memory is None else f", memory={self.memory.describe()!r}"
        return (
            f"SplitController(split_count={self.split_count}, microbatch_size={self.microbatch_size}, "
            f"fits={self._fits}, fails={self._fails}, oom_count={self.oom_count}{memory})"
        )

    # -- limits -------------------------------------------------------------------------------

    @property
    def min_microbatch_size(self) -> int:
        """Never cut microbatches smaller than this many rows."""
        return self._min_microbatch_size

    @min_microbatch_size.setter
    def min_microbatch_size(self, value: int) -> None:
        _positive_int("min_microbatch_size", value)
        self._min_microbatch_size = value
        self._resettle()

    @property
    def max_split_count(self) -> int | None:
        """Never cut a batch into more microbatches than this (``None``: no limit but its rows)."""
        return self._max_split_count

    @max_split_count.setter
    def max_split_count(self, value: int | None) -> None:
        _positive_int("max_split_count", value, allow_none=True)
        self._max_split_count = value
        self._resettle()

    # -- what to use --------------------------------------------------------------------------

    @property
    def settled(self) -> SettledSplit:
        """What the controller has settled on now (the loader tags each batch with it)."""
        return self._settled

    def _resettle(self) -> None:
        """Make :attr:`settled` anew from what the controller knows now (after every change of it)."""
        self._settled = SettledSplit(
            self._start_split_count,
            self._capacity(),
            self._min_microbatch_size,
            self._max_split_count,
            self.unit,
            self._fits,
            self,
        )

    @property
    def split_count(self) -> int:
        """The microbatches the last batch ran as, on this rank.

        Before any batch completed, the starting count; after an OOM, until the batch completes,
        the count it is retried at.
        """
        if self._ran is not None:
            return self._ran[0]
        if self._last_rows is None:
            return self._start_split_count
        return self.count_for(self._last_rows)

    @property
    def microbatch_size(self) -> int | None:
        """The largest microbatch the last batch ran (rows, or tokens), on this rank; ``None`` before any.

        After an OOM, until the batch completes, the largest microbatch a settled count keeps to:
        the largest size that fitted below the smallest failure, or half that failure while none
        fitted (a success alone limits nothing).
        """
        if self._ran is not None:
            return self._ran[1]
        return self._settled.capacity

    def _load(self, load: int | BatchLoad) -> BatchLoad:
        if isinstance(load, BatchLoad):
            if load.unit != self.unit:
                raise ValueError(
                    f"SplitController(unit={self.unit!r}) got a BatchLoad in {load.unit}: "
                    "pass batch.load(controller.unit)"
                )
            return load
        _positive_int("rows", load)
        if self.unit != "rows":
            raise TypeError(
                f"SplitController(unit={self.unit!r}) plans with each batch's lengths, not a row count {load!r}: "
                "pass batch.load('tokens') of an ElasticBatch from a loader with pad_values"
            )
        return BatchLoad(load)

    def count_for(self, load: int | BatchLoad) -> int:
        """The settled count for a batch, without probing (what the loader tags).

        Args:
            load: The batch's rows (``unit="tokens"``: its ``BatchLoad``, ``batch.load("tokens")``).

        Example:
            >>> from elastic_batches import SplitController
            >>> controller = SplitController(split_count=3)
            >>> controller.count_for(10)
            3
        """
        if type(load) is int and self.unit == "rows":  # no BatchLoad to build
            _positive_int("rows", load)
            return self._settled.count_for(load)
        return self._settled.count_for(self._load(load))

    def plan(self, load: int | BatchLoad, *, tag: int | None = None, memory: MemoryReading | None = None) -> int:
        """The count to try next on a batch; may probe a larger microbatch. The one place a count is decided.

        Predicting (a fitted memory model), the count is the fewest microbatches whose largest
        one's predicted peak keeps the margin free: the size agreed at the last vote, or the one
        ``memory`` allows now when that is smaller. After an OOM, until the next success, it is
        the more cautious of that and the search's count. Otherwise the settled count keeps to
        :attr:`microbatch_size`: while the search refines (a size fitted, a larger one failed,
        and they are more than 10% apart), it probes the count whose largest microbatch lies
        between them; with ``grow_after``, a growth probe is one microbatch fewer.

        Args:
            load: The batch's rows on this process (``unit="tokens"``: its ``BatchLoad``).
            tag: The count the batch was tagged with (``batch.split_count``). A tag above the
                settled count (set by hand, or from before the controller learned that a larger
                microbatch fits) is obeyed; one at or below it does not stop a probe.
            memory: The memory of this process now (from the step's probe): a plan predicted
                from it keeps up with memory that shrank since the last vote.

        Returns:
            A count between 1 and the batch's rows, within the limits.
        """
        load = self._load(load)  # asking changes nothing: only record_success / record_oom learn
        predicted = self._prediction(memory)
        if predicted is None:
            return self._finer(load, self._search_plan(load, tag))
        count = load.count_within(predicted)
        if self._fallback:
            count = max(count, self._search_plan(load, None))
        if tag is not None and tag > self._settled.unclamped(load):
            count = max(count, tag)
        return self._finer(load, self._settled.clamp(load.rows, count))

    def _finer(self, load: BatchLoad, count: int) -> int:
        """After an OOM on this batch: ``count`` raised until its largest piece is below the smallest failure.

        Where ``min_microbatch_size`` widens pieces (the tokens unit), a count's largest piece can
        cost more than the capacity it was planned for; each retry still cuts smaller than what
        failed, or as fine as the limits allow, so a call ends.
        """
        if not self._tried or self._fails is None:
            return count
        most = self._settled.clamp(load.rows, load.rows)
        while count < most and self.realized(load, count) >= self._fails:
            count += 1
        return count

    def realized(self, load: int | BatchLoad, count: int) -> int:
        """The cost of the largest of ``count`` pieces as the step cuts them (``min_microbatch_size`` rows at least).

        Example:
            >>> from elastic_batches import BatchLoad, SplitController
            >>> load = BatchLoad(6, lengths=[100, 10, 10, 10, 10, 10])
            >>> SplitController(unit="tokens").realized(load, 2)
            100
            >>> SplitController(unit="tokens", min_microbatch_size=3).realized(load, 2)  # pieces of 3 rows
            300
        """
        load = self._load(load)
        return load.largest(load.sizes(count, min_rows=self._min_microbatch_size))

    def _prediction(self, memory: MemoryReading | None) -> int | None:
        """The largest microbatch the memory model predicts fits: agreed at the last vote, or less now; ``None``."""
        model = self.memory
        if model is None or not model.ready:
            return None
        if self._voted and self._predicted is None:
            return None  # some rank predicts nothing at the last vote: every rank plans from the search alike
        sizes = [] if self._predicted is None else [self._predicted]
        if memory is not None and memory.capacity is not None:
            sizes.append(self._size(memory))
        return max(1, min(sizes)) if sizes else None

    def _size(self, memory: MemoryReading, *, started: bool = False) -> int:
        """The largest microbatch the model predicts fits in ``memory`` with the margin, in the controller's unit.

        Until the model was wrong on this device once, the margin costs at most a twentieth of
        the size it predicts without one (``size - size // 20``, so none below 20 rows or tokens),
        which keeps any batch within ``max(fewest + 1, 1.1 * fewest)`` microbatches: rows are
        coarse (with pieces of 3 rows, one row less is a third more microbatches), and a device
        the model was never wrong on needs no more. After an OOM it
        did not predict, the whole (widened) margin applies. A size, not a count: every rank
        votes it, and any batch's count follows from it (0: nothing fits).
        """
        model = self.memory
        assert model is not None
        size = model.largest(memory, started=started, cautious=started)
        if not model.wrong:
            exact = model.largest(memory, started=started, margin=0.0, cautious=started)
            size = max(size, exact - exact // 20)
        return size

    def forecast(self, memory: MemoryReading) -> int:
        """The largest microbatch the memory model predicts fits an attempt starting with ``memory``.

        What :class:`ElasticStep` votes after each attempt (every rank then plans from the
        smallest); 0 while the model cannot plan a whole attempt.

        Example:
            >>> from elastic_batches import SplitController
            >>> from elastic_batches.memory import MemoryReading
            >>> SplitController().forecast(MemoryReading(in_use=0, capacity=1 << 30))  # nothing measured yet
            0
        """
        if self.memory is None or not self.predicting() or memory.capacity is None:
            return 0
        return max(1, self._size(memory))

    def predicting(self) -> bool:
        """Whether plans are predicted from the memory model (fitted, and enabled).

        Example:
            >>> from elastic_batches import SplitController
            >>> SplitController().predicting()  # nothing measured yet
            False
        """
        return self.memory is not None and self.memory.ready

    def measurement(self, load: int | BatchLoad, *, smallest: int = 1) -> int:
        """Rows of a first, measuring microbatch for a batch the memory model cannot plan yet; 0: none.

        The step then cuts the rest of the batch a microbatch at a time, each at the size
        predicted from what was measured so far (:meth:`plan_rest`): the next two pieces give the
        model two sizes ``SPREAD`` apart, which it needs to plan (see ``MemoryModel.ready``). A batch
        too small for those three pieces within the limits (``max_split_count`` below 3, fewer
        than about 3.5 times the smallest piece's rows) is not measured: the search plans it,
        and its microbatches are measured all the same.

        Args:
            load: The batch's rows (``unit="tokens"``: its ``BatchLoad``).
            smallest: The fewest rows a microbatch may have for the step (2 through a
                training-mode BatchNorm); ``min_microbatch_size`` applies too.

        Example:
            >>> from elastic_batches import SplitController
            >>> SplitController().measurement(256), SplitController(margin=None).measurement(256)
            (1, 0)
            >>> SplitController(max_split_count=2).measurement(256), SplitController().measurement(3)
            (0, 0)
        """
        model = self.memory
        load = self._load(load)
        lead = self.smallest_rows(smallest)
        if model is None or not model.enabled or model.ready:
            return 0
        if self._max_split_count is not None and self._max_split_count < 3:
            return 0
        if load.rows < 2 * lead + math.ceil(_SPREAD * lead):
            return 0
        logger.info(
            "measuring memory on a batch of %d rows: a first microbatch of %d row%s, the rest cut at the sizes "
            "it predicts (memory model: %s)",
            load.rows,
            lead,
            "s" if lead != 1 else "",
            model.describe(),
        )
        return lead

    def smallest_rows(self, floor: int = 1) -> int:
        """The fewest rows a microbatch may have: ``min_microbatch_size``, or ``floor`` where that is more.

        Example:
            >>> from elastic_batches import SplitController
            >>> SplitController(min_microbatch_size=3).smallest_rows(), SplitController().smallest_rows(floor=2)
            (3, 2)
        """
        return max(self._min_microbatch_size, floor)

    def plan_rest(self, load: BatchLoad, memory: MemoryReading, done: int) -> int:
        """While measuring: the count for the rows left of a batch (``load``), ``done`` microbatches run.

        The largest microbatch predicted to fit in what ``memory`` leaves free (the attempt's
        retained memory is in use already), within the limits.

        Example:
            >>> from elastic_batches import BatchLoad, SplitController
            >>> from elastic_batches.memory import MemoryReading
            >>> controller = SplitController()
            >>> model = controller.memory  # a first microbatch of 1 row, then one of 8 rows took 1800 bytes
            >>> model.observe(1, 1100, first=True); model.observe_retained(500)
            >>> model.observe(8, 1800, first=False)  # one size: 225 bytes per row, through the origin
            >>> controller.plan_rest(BatchLoad(95), MemoryReading(in_use=500, capacity=5000), done=1)  # 19 rows fit
            5
        """
        count = load.count_within(max(1, self._size(memory, started=True)))
        if self._max_split_count is not None:
            count = min(count, max(1, self._max_split_count - done))
        return max(1, min(count, load.rows, max(1, load.rows // self._min_microbatch_size)))

    def _search_plan(self, load: BatchLoad, tag: int | None) -> int:
        """The OOM-driven search's count (what :meth:`plan` gives without a memory model)."""
        settled = self._settled.unclamped(load)
        if tag is not None and tag > settled:
            return self._settled.clamp(load.rows, tag)
        count = settled
        if self._grow_pending:
            count = settled - 1
        elif self._refining():
            assert self._fails is not None
            count = load.count_within((self._fits + self._fails) // 2)
            if count >= settled:
                count = settled - 1
            if count < 1 or load.size_at(count) >= self._fails:
                count = settled  # no count of this batch falls strictly between fits and fails
        return self._settled.clamp(load.rows, max(count, 1))

    def _refining(self) -> bool:
        """Whether a size fitted and a larger one failed, more than 10% apart: the search probes between."""
        return bool(self._fits) and self._fails is not None and 10 * self._fits < 9 * (self._fails - 1)

    def _capacity(self) -> int | None:
        """What :attr:`microbatch_size` says, worked out from what the controller knows now."""
        if self._predicted is not None and not self._fallback and self.predicting():
            return self._predicted
        if self._fails is None:
            return None  # a success is a lower bound, never a ceiling
        if self._fits:
            return self._fits
        return max(1, (self._fails + 1) // 2)

    def _learn(self, fits: int, fails: int | None) -> None:
        """Set the search bounds, and what the loader tags from them (the one place both change)."""
        self._fits, self._fails = fits, fails
        self._resettle()

    def _describe(self, count: int, load: BatchLoad) -> str:
        unit = "rows" if self.unit == "rows" else "tokens"
        return f"{count} microbatch{'es' if count != 1 else ''} of at most {load.size_at(count)} {unit}"

    def _model_note(self) -> str:
        """What an INFO line adds while a memory model has measured something: its estimate."""
        model = self.memory
        if model is None or not model.ready:
            return ""
        predicted = (
            "" if self._predicted is None else f"; it predicts microbatches of up to {self._predicted} {self.unit} fit"
        )
        return f" (memory model: {model.describe()}{predicted})"

    # -- what happened ------------------------------------------------------------------------

    def record_success(
        self,
        size: int,
        load: int | BatchLoad,
        capacity: int | None = None,
        *,
        pieces: Sequence[int] | None = None,
    ) -> None:
        """Report a step whose largest microbatch had ``size`` rows (all ranks: the smallest of them).

        Args:
            size: Rows of the largest microbatch of the step that completed (``unit="tokens"``:
                its padded positions).
            load: The batch's rows (``unit="tokens"``: its ``BatchLoad``).
            capacity: The largest microbatch the ranks' memory models predict fits (the smallest
                over ranks, from the vote); ``None`` or 0: no prediction (on some rank).
            pieces: The rows of each microbatch this rank ran, in order (what :attr:`split_count`,
                :attr:`microbatch_size` and the log report); ``None``: the balanced cut of the
                fewest microbatches of at most ``size``.
        """
        load = self._load(load)
        logged = logger.isEnabledFor(logging.INFO)  # the count before and after is only for the log line
        before = self.split_count if logged else 0
        if self._grow_pending and size > self._fits and self.grow_after is not None:
            self._grow_wait = self.grow_after  # a growth probe succeeded: probe at the base rate again
        fits, fails = max(self._fits, size), self._fails
        if fails is not None and fits >= fails:
            # Memory grew past an old failure (or that failure was at the edge): it moves to just above what
            # fitted, so a larger microbatch waits for a growth probe instead of being tried on every batch.
            fails = fits + 1
        if (fits, fails) != (self._fits, self._fails):
            self._learn(fits, fails)
        if pieces is None:
            pieces = load.sizes(load.count_within(size))
        self._ran = (len(pieces), load.largest(pieces))
        if self.memory is not None and not self._tried:
            self.memory.calm_batch()  # no OOM on this batch: a margin widened by a spike narrows back in time
        self._last_rows = load
        self._tried.clear()
        self._grow_pending = False
        self._steps_since_oom += 1
        self._predicted, self._fallback, self._voted = capacity or None, False, True
        self._resettle()
        grow_wait = None if self.predicting() else self._grow_wait  # predicting, memory that grows back is seen
        if grow_wait is not None and self._steps_since_oom >= grow_wait and self.count_for(load) > 1:
            self._grow_pending = True
            self._steps_since_oom = 0
        after = self.split_count if logged else 0
        if after != before:
            logger.info(
                "a batch of %d rows ran as %s: split count %d -> %d%s",
                load.rows,
                _pieces_text(pieces),
                before,
                after,
                self._model_note(),
            )

    def record_oom(self, size: int, load: int | BatchLoad, discarded: int = 0, capacity: int | None = None) -> None:
        """Report an OOM on a step whose largest microbatch had ``size`` rows, and learn from it.

        Args:
            size: Rows of the largest microbatch of the attempt that ran out of memory (all
                ranks: the smallest size among the ranks that ran out; ``unit="tokens"``: its
                padded positions).
            load: The batch's rows (``unit="tokens"``: its ``BatchLoad``).
            discarded: Microbatches of the attempt whose work was thrown away.
            capacity: As for :meth:`record_success`: what the ranks' memory models predict fits,
                refitted with this OOM.

        Raises:
            ElasticOOMError: no smaller microbatch is allowed (size 1, ``min_microbatch_size``,
                ``max_split_count``); the message says the batch size and what was tried.
        """
        load = self._load(load)
        rows = load.rows
        settled = self._settled.count_for(load if self.unit != "rows" else rows)  # the count before this OOM
        self.oom_count += 1
        self.discarded_microbatches += discarded
        self._tried.append(size)
        if self._grow_pending and self._grow_wait is not None and self.grow_after is not None:
            self._grow_wait = min(2 * self._grow_wait, 64 * self.grow_after)  # back off: memory did not grow
        self._grow_pending = False
        self._steps_since_oom = 0
        count = load.count_within(size)
        unit = "" if self.unit == "rows" else " tokens"
        # At the limit when the smallest largest-microbatch the limits allow is what failed. A smaller size
        # can only come from another rank (whose batch splits finer): this rank then splits all it may.
        at_limit = self.realized(load, self._settled.clamp(rows, rows)) == size
        if at_limit:
            tried = ", ".join(str(s) for s in self._tried)
            self._tried.clear()
            raise ElasticOOMError(
                f"out of memory on a batch of {rows} rows even at microbatch size {size}{unit} ({count} microbatches); "
                f"microbatch sizes tried on this batch: {tried}. Splitting cannot help further "
                f"(min_microbatch_size={self.min_microbatch_size}, max_split_count={self.max_split_count}): "
                "lower the batch size or free memory"
            )
        fails = size if self._fails is None else min(self._fails, size)
        fits = 0 if self._fits >= size else self._fits  # an OOM at a size that fitted: memory shrank
        self._predicted, self._voted, self._ran = capacity or None, True, None
        self._fallback = self.predicting()  # the retry: the more cautious of the model's plan and the search's
        self._learn(fits, fails)
        self.retry_count += 1
        self._last_rows = load
        after = self.plan(load)
        probe = f" (a probe; settled at {settled})" if count != settled else ""
        logger.info(
            "OOM at %s on a batch of %d rows%s: split count %d -> %d, %s%s",
            self._describe(count, load),
            rows,
            probe,
            count,
            after,
            self._describe(after, load),
            self._model_note(),
        )

    # -- state --------------------------------------------------------------------------------

    def forget_sizes(self) -> None:
        """Forget which sizes fitted and failed: the memory they were measured under changed (a new scheme).

        The retry of the batch that showed it counts in :attr:`retry_count`.

        Example:
            >>> import elastic_batches as eb
            >>> controller = eb.SplitController()
            >>> controller.record_oom(64, 64)
            >>> controller.forget_sizes()
            >>> controller.microbatch_size is None, controller.retry_count
            (True, 2)
        """
        self._learn(0, None)
        self._grow_pending = False
        self.retry_count += 1

    def state_dict(self) -> dict[str, Any]:
        """What the controller learned and counted, as plain values.

        Example:
            >>> from elastic_batches import SplitController
            >>> a = SplitController()
            >>> a.record_oom(size=64, load=64)
            >>> b = SplitController()
            >>> b.load_state_dict(a.state_dict())
            >>> b.plan(64), b.oom_count
            (2, 1)
        """
        return {
            "version": _STATE_VERSION,
            "start_split_count": self._start_split_count,
            "fits": self._fits,
            "fails": self._fails,
            "last_rows": None if self._last_rows is None else self._last_rows.rows,
            "last_lengths": None
            if self._last_rows is None or self._last_rows.lengths is None
            else list(self._last_rows.lengths),
            "unit": self.unit,
            "steps_since_oom": self._steps_since_oom,
            "grow_pending": self._grow_pending,
            "grow_wait": self._grow_wait,
            "oom_count": self.oom_count,
            "retry_count": self.retry_count,
            "discarded_microbatches": self.discarded_microbatches,
            "memory": None if self.memory is None else self.memory.state_dict(),
            "predicted": self._predicted,
            "fallback": self._fallback,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned: every field is checked before any is applied.

        A state of version 1 (written before the memory model existed) loads too: the search's
        bounds and counters are restored, and the memory model starts with nothing measured
        (the first batch is measured again). A controller with ``margin=None`` ignores the
        memory model of a state, and takes the size it predicted fits as the search's bound (a
        larger size counts as failed), so it starts at the count the predicting run had learned;
        one with a margin keeps the larger of its own and the state's.

        Raises:
            ValueError: keys are missing or unexpected (both are named), the version is not one
                this code reads, or a field has the wrong type or range (named); the controller is
                then unchanged.
        """
        version = state.get("version")
        check_state_dict(
            "SplitController",
            state,
            _STATE_KEYS_V1 if version == 1 else _STATE_KEYS,
            _STATE_VERSION if version != 1 else 1,
        )
        if state["unit"] != self.unit:
            raise ValueError(
                f"SplitController.load_state_dict: the state was learned with unit={state['unit']!r}, this "
                f"controller has unit={self.unit!r}: create it with SplitController(unit={state['unit']!r})"
            )
        fields = StateFields("SplitController", state)
        for key, low in (("start_split_count", 1), ("fits", 0), ("steps_since_oom", 0), ("oom_count", 0)):
            fields.int(key, low=low)
        for key in ("retry_count", "discarded_microbatches"):
            fields.int(key, low=0)
        for key in ("fails", "last_rows", "grow_wait"):
            fields.int(key, low=1, allow_none=True)
        fields.bool("grow_pending")
        if state["fails"] is not None and state["fits"] >= state["fails"]:
            raise fields.error("fits", f"below fails={state['fails']} (the smallest size that failed)")
        last: BatchLoad | None = None
        if state["last_rows"] is not None:
            lengths = state["last_lengths"]
            if lengths is not None and (not isinstance(lengths, (list, tuple)) or not all(map(is_int, lengths))):
                raise fields.error("last_lengths", "None or a list of ints")
            try:
                last = BatchLoad(state["last_rows"], lengths)
            except ValueError as err:
                raise fields.error("last_lengths", f"one length per row of last_rows ({err})") from err
        elif state["last_lengths"] is not None:
            raise fields.error("last_lengths", "None when last_rows is None")
        memory: MemoryModel | None = None
        if self.memory is not None:
            memory = MemoryModel(self.memory.base_margin, unit=self.unit)
            if version != 1 and state["memory"] is not None:
                if not isinstance(state["memory"], Mapping):
                    raise fields.error("memory", "None or a dict from MemoryModel.state_dict()")
                try:
                    memory.load_state_dict(state["memory"])
                except ValueError as err:
                    raise ValueError(f"SplitController.load_state_dict: state['memory']: {err}") from err
        if version != 1:
            fields.int("predicted", low=1, allow_none=True)
            fields.bool("fallback")
        fits, fails = state["fits"], state["fails"]
        if memory is None and version != 1 and state["predicted"] is not None:
            # Learned by prediction, planned by the search: what the model predicted fits bounds the search.
            predicted = state["predicted"]
            fails = predicted + 1 if fails is None else min(fails, predicted + 1)
            fits = min(fits, predicted)
        self._start_split_count = state["start_split_count"]
        self.memory = memory
        self._predicted = None if version == 1 or memory is None else state["predicted"]
        self._fallback = False if version == 1 or memory is None else state["fallback"]
        self._voted = False
        self._ran = None
        self._learn(fits, fails)
        self._last_rows = last
        self._steps_since_oom = state["steps_since_oom"]
        self._grow_pending = state["grow_pending"]
        self._grow_wait = state["grow_wait"]
        self._tried.clear()
        self.oom_count = state["oom_count"]
        self.retry_count = state["retry_count"]
        self.discarded_microbatches = state["discarded_microbatches"]


def _pieces_text(pieces: Sequence[int]) -> str:
    """``6 microbatches of 43 rows``, ``9 microbatches of 1 to 74 rows``."""
    low, high = min(pieces), max(pieces)
    rows = f"{high} row{'s' if high != 1 else ''}" if low == high else f"{low} to {high} rows"
    return f"{len(pieces)} microbatch{'es' if len(pieces) != 1 else ''} of {rows}"

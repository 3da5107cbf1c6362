"""``SplitController``: how many microbatches a batch is cut into, learned from OOMs and measured memory.

The feedback channel between the loader (which tags batches with :attr:`SplitController.settled`)
and the step side (which reports each success and each OOM). It learns in *microbatch sizes*
(rows, or with ``unit="tokens"`` padded positions, per microbatch), so that what it learned on
one batch applies to another, and holds the parts that decide: the OOM-driven search
(:mod:`elastic_batches.search`), the prediction from measured memory
(:mod:`elastic_batches.memory`), and the plan of each attempt (:mod:`elastic_batches.plan`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from elastic_batches._state import positive_int
from elastic_batches.balance import BatchLoad
from elastic_batches.controller_log import limit_error, log_oom, log_success, logger
from elastic_batches.controller_state import read_state, write_state
from elastic_batches.memory.model import MemoryModel, check_margin
from elastic_batches.memory.predictor import Predictor
from elastic_batches.memory.probe import MemoryReading
from elastic_batches.plan import Plan, measuring_lead, planned_count, realized
from elastic_batches.search import SizeSearch
from elastic_batches.settled import SettledSplit

__all__ = ["SettledSplit", "SplitController"]


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
        memory: The :class:`~elastic_batches.memory.MemoryModel` the step feeds (``None``
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
        positive_int("SplitController", "split_count", split_count)
        positive_int("SplitController", "min_microbatch_size", min_microbatch_size)
        positive_int("SplitController", "max_split_count", max_split_count, allow_none=True)
        positive_int("SplitController", "grow_after", grow_after, allow_none=True)
        if margin is not None:
            check_margin("SplitController", margin)
        if max_split_count is not None and split_count > max_split_count:
            raise ValueError(
                f"SplitController: split_count={split_count} exceeds max_split_count={max_split_count}; "
                "lower split_count or raise max_split_count"
            )
        self._min_microbatch_size = min_microbatch_size
        self._max_split_count = max_split_count
        self.unit = unit
        self._start_split_count = split_count
        self._search = SizeSearch(grow_after)
        self._predictor = None if margin is None else Predictor(MemoryModel(margin, unit=unit))
        self._token = object()  # what the batches this controller tags carry instead of a reference to it
        self._resettle()
        self._last_rows: BatchLoad | None = None
        self._ran: tuple[int, int] | None = None  # the last batch that completed: its microbatches, its largest
        self._tried: list[int] = []  # sizes that failed on the current batch, for error messages
        self.oom_count = 0
        self.retry_count = 0
        self.discarded_microbatches = 0

    def __repr__(self) -> str:
        memory = "" if self.memory is None else f", memory={self.memory.describe()!r}"
        return (
            f"SplitController(split_count={self.split_count}, microbatch_size={self.microbatch_size}, "
            f"fits={self._search.fits}, fails={self._search.fails}, oom_count={self.oom_count}{memory})"
        )

    @property
    def min_microbatch_size(self) -> int:
        """Never cut microbatches smaller than this many rows."""
        return self._min_microbatch_size

    @min_microbatch_size.setter
    def min_microbatch_size(self, value: int) -> None:
        positive_int("SplitController", "min_microbatch_size", value)
        self._min_microbatch_size = value
        self._resettle()

    @property
    def max_split_count(self) -> int | None:
        """Never cut a batch into more microbatches than this (``None``: no limit but its rows)."""
        return self._max_split_count

    @max_split_count.setter
    def max_split_count(self, value: int | None) -> None:
        positive_int("SplitController", "max_split_count", value, allow_none=True)
        self._max_split_count = value
        self._resettle()

    @property
    def grow_after(self) -> int | None:
        """Steps without an OOM before the search probes one microbatch fewer (``None``: never)."""
        return self._search.grow_after

    @property
    def settled(self) -> SettledSplit:
        """What the controller has settled on now (the loader tags each batch with it)."""
        return self._settled

    def _resettle(self) -> None:
        """Make :attr:`settled` anew from what the controller knows now (after every change of it)."""
        trusted = None if self._predictor is None else self._predictor.trusted()
        self._settled = SettledSplit(
            self._start_split_count,
            trusted if trusted is not None else self._search.capacity(),
            self._min_microbatch_size,
            self._max_split_count,
            self.unit,
            self._search.fits,
            self._token,
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
        positive_int("SplitController", "rows", load)
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
            positive_int("SplitController", "rows", load)
            return self._settled.count_for(load)
        return self._settled.count_for(self._load(load))

    def plan(self, load: int | BatchLoad, *, tag: int | None = None, memory: MemoryReading | None = None) -> int:
        """The count to try next on a batch; may probe a larger microbatch (see ``plan.planned_count``).

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
        retrying = self._search.fails if self._tried else None
        return planned_count(load, tag, memory, self._settled, self._search, self._predictor, retrying)

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
        return realized(self._load(load), count, self._min_microbatch_size)

    def forecast(self, memory: MemoryReading) -> int:
        """The largest microbatch the memory model predicts fits an attempt starting with ``memory``.

        What :class:`ElasticStep` votes after each attempt (every rank then plans from the
        smallest); 0 while the model cannot plan a whole attempt (see ``Predictor.forecast``).
        """
        return 0 if self._predictor is None else self._predictor.forecast(memory)

    def predicting(self) -> bool:
        """Whether plans are predicted from the memory model (fitted, and enabled)."""
        return self._predictor is not None and self._predictor.ready

    def plan_attempt(
        self,
        load: int | BatchLoad,
        *,
        tag: int | None = None,
        memory: MemoryReading | None = None,
        measure: bool = False,
        floor: int = 1,
    ) -> Plan:
        """The :class:`~elastic_batches.plan.Plan` of the next attempt at a batch: the one place its cut is decided.

        The count is :meth:`plan`'s; no piece has fewer than ``min_microbatch_size`` rows, nor
        than ``floor`` (2 through a training-mode BatchNorm). With ``measure`` (the first attempt
        of a call, with a probe's ``memory``), a batch the memory model cannot plan yet is
        measured: a first microbatch of the fewest rows allowed, the rest cut as it goes
        (:class:`~elastic_batches.plan.Ramp`).

        Example:
            >>> from elastic_batches import SplitController
            >>> controller = SplitController(split_count=3)
            >>> controller.plan_attempt(10).sizes, controller.plan_attempt(5, floor=2).sizes
            ((4, 3, 3), (3, 2))
        """
        load = self._load(load)
        count = self.plan(load, tag=tag, memory=memory)
        smallest = max(self._min_microbatch_size, floor)
        lead = measuring_lead(load, self._predictor, smallest, self._max_split_count) if measure and memory else 0
        return Plan.cut(load, count, lead=lead, smallest=smallest, max_split_count=self._max_split_count)

    @property
    def memory(self) -> MemoryModel | None:
        """The :class:`~elastic_batches.memory.MemoryModel` the step feeds (``None`` with ``margin=None``)."""
        return None if self._predictor is None else self._predictor.model

    @property
    def predictor(self) -> Predictor | None:
        """What plans are predicted from: the memory model and the ranks' last vote (``None`` with ``margin=None``)."""
        return self._predictor

    def _note(self) -> str:
        return "" if self._predictor is None else self._predictor.note(self.unit)

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
        self._search.succeeded(size)
        if pieces is None:
            pieces = load.sizes(load.count_within(size))
        self._ran = (len(pieces), load.largest(pieces))
        if self._predictor is not None:
            self._predictor.succeeded(capacity, calm=not self._tried)
        self._last_rows = load
        self._tried.clear()
        self._resettle()
        self._search.schedule_growth(self.count_for(load), predicting=self.predicting())
        if logged and self.split_count != before:
            log_success(load, pieces, before, self.split_count, self._note())

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
        self._search.interrupted()
        count = load.count_within(size)
        # At the limit when the smallest largest-microbatch the limits allow is what failed. A smaller size
        # can only come from another rank (whose batch splits finer): this rank then splits all it may.
        at_limit = self.realized(load, self._settled.clamp(rows, rows)) == size
        if at_limit:
            tried = list(self._tried)
            self._tried.clear()
            raise limit_error(self, load, size, count, tried)
        self._search.failed(size)
        self._ran = None
        if self._predictor is not None:
            self._predictor.failed(capacity)
        self._resettle()
        self.retry_count += 1
        self._last_rows = load
        if logger.isEnabledFor(logging.INFO):
            log_oom(load, self.unit, count, settled, self.plan(load), self._note())

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
        self._search.forget()
        self._resettle()
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
        return write_state(
            self._start_split_count,
            self._search,
            self._last_rows,
            self.unit,
            (self.oom_count, self.retry_count, self.discarded_microbatches),
            self._predictor,
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned: every field is checked before any is applied.

        A state of version 1 (before the memory model) loads too, and a controller with
        ``margin=None`` takes the size a predicting run agreed fits as its search's bound (see
        ``controller_state.read_state``).

        Raises:
            ValueError: keys are missing or unexpected (both are named), the version is not one
                this code reads, or a field has the wrong type or range (named); the controller is
                then unchanged.
        """
        loaded = read_state(state, unit=self.unit, margin=None if self.memory is None else self.memory.base_margin)
        self._start_split_count = loaded.start_split_count
        self._predictor = None if loaded.memory is None else Predictor(loaded.memory)
        if self._predictor is not None:
            self._predictor.agreed, self._predictor.fallback = loaded.predicted, loaded.fallback
        self._ran = None
        search = self._search
        search.fits, search.fails = loaded.fits, loaded.fails
        search.steps_since_oom, search.grow_pending, search.grow_wait = loaded.growth
        self._resettle()
        self._last_rows = loaded.last
        self._tried.clear()
        self.oom_count, self.retry_count, self.discarded_microbatches = loaded.counters

"""``MemoryModel``: the bytes an attempt at a batch needs, fitted from measured peaks.

An attempt at a batch starts with some memory in use (the weights, the optimizer state, the
batch). Over it, the model says, the attempt needs

    retained + fixed + per_unit * size

bytes at its peak, ``size`` being its largest microbatch in the controller's unit (rows, or
padded tokens):

- ``retained``: what the attempt keeps from its first microbatch to the end (the gradients it
  accumulates into), measured as the growth of the memory in use from the start of the attempt to
  the start of its second microbatch;
- ``fixed + per_unit * size``: what one microbatch needs over the memory in use before it
  (activations, temporaries, the gradient being accumulated), a line through the increments
  measured for microbatches after the first of their attempt, raised until it lies on or above
  every one. A failure (an OOM of a microbatch of ``size`` with ``b`` bytes free) says the
  increment at ``size`` and beyond exceeds ``b``; between the largest size measured below it and
  ``size`` the increment rises on a line to that bound, and the sizes measured keep their line.

The first microbatch of an attempt creates the gradients while its activations are freed, so its
increment differs from the others'; it bounds theirs from above (every gradient a later
microbatch holds, the first had allocated at the same point of backward), and per unit through
the origin until a later microbatch is measured: ``per_unit = increment / size``, which
over-estimates any larger microbatch.

Increments are kept per size (the latest measurement of each of the last sixteen sizes). The line
is a least-squares fit when the sizes spread by ``SPREAD`` or more (flat if it falls), else through the
origin. A measurement more than ``_FELL`` below what the sizes measured around it say (at its own size,
or between two) means memory per microbatch fell (a layer frozen, shorter shapes), one more than
twice it that memory per microbatch grew (a layer unfrozen: its gradients are accumulated too):
either way the older points are dropped, and the model measures again before it plans. Between two sizes measured,
the chord between their increments where it lies below the line: a peak is often the larger of
two lines (the gradient being accumulated at small sizes, the activations at large ones), a
shape that lies under its chords, and a line raised over both over-estimates the sizes between.
Beyond the largest size measured, that measurement continued at the slope of the measurements
just below it, and at no less than ``_BACKWARD`` times the bytes per unit the forwards held (the saved
activations, which backward needs, and a quarter more for their gradients).

A plan keeps the predicted peak under the capacity minus ``margin`` of it. An OOM that the model
did not predict (it said the microbatch fits in what was free when it failed) widens the margin
(``+ max(margin, 0.05)``, up to 0.5); after four, prediction turns itself off and the
controller's OOM-driven search plans alone. A widened margin is a lesson of one moment (a spike
of memory, another process): after ``RECOVER_AFTER`` (8) batches without an OOM it narrows back
one step and the failures it learned are forgotten, so memory that came back is used again within
8 batches a step; an OOM the model did not predict within as many batches of a narrowing doubles
that wait (up to 64 times). Kept at narrowings: a failure in an attempt planned from the model that
no measurement contradicts (no microbatch of its size or larger fitted in what was free when it
failed: not a spike but the model's own error there, such as a caching allocator's new segment),
so that the size is not tried again at each. One in a measuring attempt, whose cache the pieces
of other sizes shaped, moves up instead: at each narrowing, the size it bounds from moves one
unit past the size that failed, then three, seven, ... (the distance doubled and one more), so
that a planned attempt tries the size that failed again before any larger one; once that size (or
a larger one) fits in what was free when it failed (a spike, or the ramp's fragmentation), or the
distance passes the size, it is forgotten. A kept failure goes when a measurement contradicts it,
or when memory per microbatch falls.

The model plans only once its line has a slope from measurements (:attr:`MemoryModel.ready`: two
sizes of later microbatches ``SPREAD`` or more apart): a line through the origin takes the bytes every
microbatch needs whatever its size (the gradient being accumulated) for bytes per row, and would
plan microbatches far smaller than fit.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Mapping
from typing import Any

from elastic_batches._state import StateFields, check_state_dict, is_int, is_number
from elastic_batches.memory.probe import MemoryReading

__all__ = ["RECOVER_AFTER", "SPREAD", "MemoryModel", "check_margin", "format_bytes"]

logger = logging.getLogger("elastic_batches.memory_model")  # the name it logged under before the subpackage

_STATE_VERSION = 4
_STATE_KEYS_V1 = frozenset(
    {"version", "unit", "base_margin", "margin", "retained", "later", "first", "failures", "wrong", "enabled"}
)
_STATE_KEYS_V2 = _STATE_KEYS_V1 | {"calm", "recover_after", "probation"}  # version 2: the margin narrows back
_STATE_KEYS_V3 = _STATE_KEYS_V2 | {"kept"}  # version 3: failures of planned attempts kept at narrowings
_STATE_KEYS = _STATE_KEYS_V3 | {"moved"}  # version 4: failures of measuring attempts move up at narrowings
_SIZES = 16  # increments kept, one per size
_LARGEST = 1 << 62  # no microbatch is larger
_FIRSTS = 4  # first microbatches' increments kept
_FAILURES = 4
SPREAD = 1.5  # sizes this far apart give the line its slope
_FELL = 0.05  # a measurement this far below the sizes measured around it: memory per microbatch fell
_GREW = 1.0  # this far above (twice): memory per microbatch grew (a layer unfrozen, longer shapes)
_MAX_MARGIN = 0.5
_MAX_WRONG = 4  # OOMs the model did not predict, before prediction turns off
_BACKWARD = 1.25  # a microbatch's peak over what its forward held: its saved activations, a quarter more
RECOVER_AFTER = 8  # batches without an OOM after which a widened margin narrows back one step
_MAX_RECOVER = 64 * RECOVER_AFTER


def check_margin(owner: str, margin: Any) -> None:
    """Refuse a margin that is not a float in ``[0, 0.5]``."""
    if not is_number(margin) or not 0 <= margin <= _MAX_MARGIN:
        raise ValueError(
            f"{owner}: margin must be a fraction of the capacity in [0, {_MAX_MARGIN}] (0.05 keeps 5% free), or None "
            f"to turn prediction off; got {margin!r}"
        )


def format_bytes(n: float) -> str:
    """``1.50 MiB``."""
    size, unit = float(n), "bytes"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{int(size)} bytes" if unit == "bytes" else f"{size:.2f} {unit}"


class MemoryModel:
    """Fixed bytes plus bytes per row (or padded token), fitted from the peaks measured around microbatches.

    Each :class:`SplitController` with a ``margin`` holds one (``controller.memory``);
    :class:`ElasticStep` feeds it what its :class:`~elastic_batches.memory.MemoryProbe` measures.

    Args:
        margin: The fraction of the capacity a plan keeps free (fragmentation, what the model
            does not see); it grows after an OOM the model did not predict.
        unit: ``"rows"`` or ``"tokens"``: what a size counts.

    Attributes:
        retained: Bytes an attempt keeps from its first microbatch on (``None``: not measured yet).
        fixed: Bytes a microbatch needs whatever its size, over what is in use before it.
        per_unit: Bytes a microbatch needs per row (or padded token).
        margin: The fraction of the capacity kept free now.
        wrong: OOMs the model did not predict.
        enabled: ``False`` once the model was wrong more than four times: it predicts nothing.
        calm: Batches without an OOM since the margin last changed.
        recover_after: Calm batches after which a widened margin narrows one step (``RECOVER_AFTER``,
            doubled when an OOM it did not predict follows a narrowing).
        probation: The margin narrowed and has not yet held for ``recover_after`` batches.
        unprobed: The device a step found no memory probe for (``describe`` says so), or ``None``.

    Example:
        >>> from elastic_batches.memory import MemoryModel, MemoryReading
        >>> model = MemoryModel(margin=0.05)
        >>> model.observe(size=1, increment=500, first=True)  # the first microbatch of an attempt
        >>> model.observe_retained(400)  # what it left allocated: the gradients
        >>> model.observe(size=10, increment=1100, first=False)
        >>> model.observe(size=20, increment=2100, first=False)
        >>> model.fixed, model.per_unit, model.predict(20)
        (100.0, 100.0, 2500)
        >>> model.largest(MemoryReading(in_use=1000, capacity=3000))  # 2850 usable: 1000 + 400 + 100 + 13 * 100
        13
        >>> model.largest(MemoryReading(in_use=1000, capacity=6000))  # beyond 20: the slope from 10 to 20 goes on
        42
    """

    def __init__(self, margin: float = 0.05, *, unit: str = "rows") -> None:
        check_margin("MemoryModel", margin)
        if unit not in ("rows", "tokens"):
            raise ValueError(f"MemoryModel: unit must be 'rows' or 'tokens', got {unit!r}")
        self.unit = unit
        self.base_margin = float(margin)
        self.margin = float(margin)
        self.retained: int | None = None
        self.fixed = 0.0
        self.per_unit = 0.0
        self.wrong = 0
        self.enabled = True
        self.calm = 0  # batches without an OOM since the margin last changed
        self.recover_after = RECOVER_AFTER  # calm batches before a widened margin narrows one step
        self.probation = False  # narrowed, and not yet calm for recover_after batches since
        self.unprobed: str | None = None  # the device a step found no memory probe for (what describe() says)
        self._later: dict[int, int] = {}  # size -> increment of a microbatch after the first, latest last
        self._first: dict[int, int] = {}
        self._failures: dict[int, int] = {}  # size -> bytes that were free when a microbatch of that size failed
        self._kept: set[int] = set()  # sizes of failures in planned attempts: kept at narrowings unless contradicted
        self._moved: dict[int, int] = {}  # size it bounds from -> size that failed, for a measuring attempt's failure
        self._forward: dict[int, int] = {}  # size -> bytes a microbatch after the first held when its forward ended
        self._spread = False  # the line's slope comes from sizes SPREAD apart (else: through the origin)

    def __repr__(self) -> str:
        return f"MemoryModel({self.describe()})"

    @property
    def ready(self) -> bool:
        """Whether the model can plan a whole attempt: later microbatches of two sizes ``SPREAD`` apart were measured.

        With one size only, the line goes through the origin: an upper bound that plans far
        smaller microbatches than fit where a microbatch needs bytes whatever its size.
        """
        return self.enabled and bool(self._later) and self._spread and self.retained is not None

    @property
    def spread(self) -> bool:
        """Whether the line's slope comes from measured sizes ``SPREAD`` or more apart (else: through the origin)."""
        return self._spread

    def describe(self) -> str:
        """The estimate in words, as logged: ``1.23 MiB + 12.00 KiB per row, margin 5%``."""
        if not self.enabled:
            return f"off after {self.wrong} OOMs it did not predict"
        if not (self._later or self._first):
            if self.unprobed is not None:
                return f"nothing measured: no memory probe on {self.unprobed} (the OOM-driven search plans)"
            return f"nothing measured yet, margin {self.margin:.0%}"
        unit = "row" if self.unit == "rows" else "token"
        fixed = (self.retained or 0) + self.fixed
        return f"{format_bytes(fixed)} + {format_bytes(self.per_unit)} per {unit}, margin {self.margin:.0%}"

    # -- what it predicts ---------------------------------------------------------------------

    def increment(self, size: int, *, cautious: bool = False) -> int:
        """Bytes a microbatch of ``size`` needs over the memory in use before it.

        Up to the largest size measured, the line, or the chord between the two sizes measured
        around ``size`` where it is lower. Beyond it, the largest measurement continued at the
        slope of the measurements nearest below it (the secant from the largest size a third or
        more below), and at no less than ``_BACKWARD`` times the bytes the forwards held per unit (what
        backward frees: the saved activations, and a quarter more for their gradients). A
        failure raises it from its size on (see :meth:`observe_failure`).
        """
        measured = self._measured(size, cautious=cautious)
        return math.ceil(round(max(measured, self._failed(size)), 6))  # not a byte more for float rounding

    def _measured(self, size: int, *, cautious: bool = False) -> float:
        """What the measurements say: between two sizes measured, the chord between them where it lies below
        the line (a peak that grows faster at larger sizes lies under its chords); beyond the largest, the line
        and the continuation of the slope there."""
        line = self.fixed + self.per_unit * size
        top = self._top()
        if top is None:
            return line
        if size > top[0]:
            slope = max(self._beyond_slope(), top[1] / top[0]) if cautious else self._beyond_slope()
            return top[1] + slope * (size - top[0])
        sizes = sorted(self._later)
        above = bisect.bisect_left(sizes, size)
        if above == 0 or sizes[above] == size:
            return min(line, self._later[size]) if sizes[above] == size else line
        low, high = sizes[above - 1], sizes[above]
        chord = self._later[low] + (self._later[high] - self._later[low]) * (size - low) / (high - low)
        return min(line, max(chord, self._later[low]))

    def _failed(self, size: int) -> float:
        """What the failures say a microbatch of ``size`` needs at least (0: nothing).

        A failure at ``failed`` with ``free`` bytes free: at ``failed``, a unit's bytes (the line's
        ``per_unit``, at least one byte) more than ``free`` (the bytes in use differ by a small tensor or
        two from one reading to the next: a plan must not try the size again for a few bytes more),
        and as many more for each unit beyond; from the largest size measured below ``failed``, a line
        up to that bound.
        """
        bound = 0.0
        measured = self._later or self._first
        for failed, free in self._failures.items():
            at_failed = free + max(1.0, self.per_unit)
            if size >= failed:
                bound = max(bound, at_failed + self.per_unit * (size - failed))
                continue
            below = [s for s in measured if s < failed]
            low = max(below, default=0)
            if size > low:
                base = self._measured(low) if low else 0.0
                bound = max(bound, base + (at_failed - base) * (size - low) / (failed - low))
        return bound

    def _top(self) -> tuple[int, int] | None:
        """The largest size measured after a first microbatch, and its increment."""
        if not self._later:
            return None
        size = max(self._later)
        return size, self._later[size]

    def _top_slope(self) -> float:
        """Bytes per unit at the largest size measured: the secant from the largest size a third below, else
        through the origin."""
        top = self._top()
        assert top is not None
        below = [s for s in self._later if s * SPREAD <= top[0]]
        if not below:
            return top[1] / top[0]
        low = max(below)
        return max(0.0, (top[1] - self._later[low]) / (top[0] - low))

    def _beyond_slope(self) -> float:
        """Bytes per unit beyond the largest size measured: the secant there, >= ``_BACKWARD`` times the forwards'."""
        forward = max((held / size for size, held in self._forward.items()), default=0.0)
        return max(self._top_slope(), _BACKWARD * forward)

    def predict(self, size: int) -> int:
        """Bytes an attempt whose largest microbatch has ``size`` needs over the memory in use at its start."""
        return (self.retained or 0) + self.increment(size)

    def largest(
        self, reading: MemoryReading, *, started: bool = False, margin: float | None = None, cautious: bool = False
    ) -> int:
        """The largest microbatch (in the unit) whose predicted peak keeps ``margin`` of the capacity free.

        Args:
            reading: The memory now.
            started: The attempt has run its first microbatch: ``retained`` is in use already.
            margin: Another margin than the model's own (0: the capacity whole).
            cautious: Beyond the largest size measured, at least that size's bytes per unit (the line
                through the origin there): while a batch is measured, its pieces grow from a few small
                sizes, whose slope under-estimates larger ones.

        Returns:
            A size, 0 when not even the fixed part fits or nothing is known.
        """
        if reading.capacity is None or not (self._later or self._first):
            return 0
        available = reading.capacity * (1.0 - (self.margin if margin is None else margin)) - reading.in_use
        if not started:
            available -= self.retained or 0
        if available < self.fixed:
            return 0
        high = 1  # the increment never falls with the size: the largest size that fits, by bisection
        while self.increment(high, cautious=cautious) <= available and high < _LARGEST:
            high *= 2
        low = 0
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if self.increment(middle, cautious=cautious) <= available else (low, middle - 1)
        return low

    def observe(self, size: int, increment: int, *, first: bool, forward: int | None = None) -> None:
        """A microbatch of ``size`` took ``increment`` bytes at its peak over what was in use before it.

        Args:
            size: Its size in the unit.
            increment: Its peak minus the bytes in use when it started.
            first: It was the first microbatch of its attempt.
            forward: The bytes it held over that when its forward ended (``None``: not measured).
        """
        if size < 1:
            return
        increment = max(0, int(increment))
        points = self._first if first else self._later
        if not first and forward is not None:
            self._forward.pop(size, None)
            self._forward[size] = max(0, int(forward))
            while len(self._forward) > _FIRSTS:
                self._forward.pop(next(iter(self._forward)))
        expected = 0.0 if first else self._expected(size)
        fell = increment < (1.0 - _FELL) * expected
        if fell or (expected and increment > (1.0 + _GREW) * expected):
            self._later.clear()  # memory per microbatch fell or grew: what was measured before no longer holds
        if fell:  # the failures bound a larger need than there is now (when it grew, they still hold)
            for failed in list(self._failures):
                self._forget(failed)
        points.pop(size, None)
        points[size] = increment
        while len(points) > (_FIRSTS if first else _SIZES):
            points.pop(next(iter(points)))
        if not first:  # a failure that a larger microbatch contradicts no longer holds
            for failed in [s for s, free in self._failures.items() if self._contradicts(s, free, size, increment)]:
                self._forget(failed)
        self._fit()

    def _expected(self, size: int) -> float:
        """What the measurements say a later microbatch of ``size`` takes: at that size, or between two sizes
        measured around it (0 outside them: the line, raised over every point, says too little there)."""
        if size in self._later:
            return self._later[size]
        if self._later and min(self._later) < size < max(self._later):
            return self._measured(size)
        return 0.0

    def failed_at(self, size: int) -> bool:
        """Whether a microbatch of ``size`` or smaller ran out of memory (a failure the model still holds)."""
        return any(failed <= size for failed in self._failures)

    def observe_retained(self, nbytes: int) -> None:
        """The memory in use grew by ``nbytes`` from the start of an attempt to its second microbatch."""
        self.retained = max(0, int(nbytes))

    def observe_failure(self, size: int, free: int, *, first: bool, measuring: bool = False) -> bool:
        """A microbatch of ``size`` ran out of memory with ``free`` bytes of the capacity free when it started.

        The model is refitted so that it predicts the failure. Returns whether the model was
        wrong: it had predicted that the microbatch fits in ``free`` (then the margin widens);
        a failure it predicted (the capacity shrank after the plan) changes only the fit.
        ``measuring``: the attempt was measuring (its pieces of other sizes shaped the cache), so
        the failure moves up at each narrowing (see :meth:`calm_batch`); one of a planned attempt
        is kept then, unless a measurement contradicts it.
        """
        if first:  # the first microbatch's peak is bounded by the whole attempt's: retained + increment
            need, bound = self.predict(size), free - (self.retained or 0)
        else:
            need, bound = self.increment(size), free
        wrong = self.enabled and bool(self._later or self._first) and need <= free
        self._forget(size)
        self._failures[size] = max(0, int(bound))
        if not measuring:
            self._kept.add(size)
        while len(self._failures) > _FAILURES:
            self._forget(next(iter(self._failures)))
        self._fit()
        if wrong:
            self.widen(f"a microbatch of {size} {self.unit} ran out of memory where it predicted {format_bytes(need)}")
        return wrong

    def calm_batch(self) -> None:
        """A batch completed without an OOM: after ``recover_after`` of them, a widened margin narrows one step.

        Narrowing halves the margin (not below the one it started with), counts one wrong
        prediction less and forgets the failures learned, so that memory that came back after a
        spike is planned with again; but not those of planned attempts that no measurement
        contradicts (beyond every size that fitted: the model's own error there), which would
        otherwise run out of memory again at every narrowing. One of a measuring attempt that no
        measurement contradicts moves up (one unit past its size, then three, seven, ...; forgotten
        once that distance passes its size, or once its own size fits): a planned attempt tries the
        size that failed before any larger, so where it does not fit it costs one OOM, not one for
        each size between it and the line's.

        Example:
            >>> from elastic_batches.memory import RECOVER_AFTER, MemoryModel
            >>> model = MemoryModel(margin=0.05)
            >>> model.widen("a spike")
            >>> for _ in range(RECOVER_AFTER):
            ...     model.calm_batch()
            >>> model.margin, model.wrong
            (0.05, 0)
        """
        if self.probation and self.calm + 1 >= self.recover_after:
            self.probation, self.recover_after = False, RECOVER_AFTER  # the narrowing held
        held = {s for s, free in self._failures.items() if not self._contradicted(s, free)}
        forgotten = [s for s in self._failures if s not in self._kept or s not in held]  # moved up, or gone
        if self.wrong == 0 and not forgotten:
            self.calm = 0
            return
        self.calm += 1
        if self.calm < self.recover_after:
            return
        before = self.margin
        self.calm, self.probation = 0, True
        self.wrong = max(0, self.wrong - 1)
        self.margin = max(self.base_margin, self.margin / 2)
        for size in forgotten:
            free, origin = self._failures[size], self._moved.get(size, size)
            self._forget(size)
            moved = 2 * size - origin + 1  # one unit past it, then the distance doubled and one more
            if size in held and moved - origin <= origin and moved not in self._failures:  # a measuring attempt's
                self._failures[moved], self._moved[moved] = free, origin
        self._fit()
        kept = f", {len(self._failures)} kept or moved up" if self._failures else ""
        logger.info(
            "memory model: %d batches without an OOM: margin %.0f%% -> %.0f%%, the failures learned forgotten%s",
            self.recover_after,
            100 * before,
            100 * self.margin,
            kept,
        )

    def _forget(self, size: int) -> None:
        """Drop the failure at ``size`` (if any), with what it was kept or moved for."""
        self._failures.pop(size, None)
        self._kept.discard(size)
        self._moved.pop(size, None)

    def _contradicts(self, failed: int, free: int, size: int, increment: int) -> bool:
        """Whether a later microbatch of ``size`` that took ``increment`` bytes contradicts the failure at ``failed``
        with ``free`` bytes free: as large (as the size that failed, for a moved failure), in no more bytes."""
        return size >= self._moved.get(failed, failed) and increment <= free

    def _contradicted(self, failed: int, free: int) -> bool:
        """Whether a measured later microbatch contradicts the failure at ``failed`` (see :meth:`_contradicts`)."""
        return any(self._contradicts(failed, free, size, increment) for size, increment in self._later.items())

    def widen(self, why: str) -> None:
        """An OOM the model did not predict: keep more of the capacity free; after four, predict nothing."""
        if self.probation:  # soon after a narrowing: wait longer before the next
            self.recover_after = min(_MAX_RECOVER, 2 * self.recover_after)
            self.probation = False
        self.calm = 0
        self.wrong += 1
        before = self.margin
        self.margin = min(_MAX_MARGIN, self.margin + max(self.margin, 0.05))
        if self.wrong > _MAX_WRONG:
            self.enabled = False
            logger.info(
                "memory model: %s, the %d. OOM it did not predict: prediction off, the OOM-driven search plans alone",
                why,
                self.wrong,
            )
            return
        logger.info("memory model: %s: margin %.0f%% -> %.0f%%", why, 100 * before, 100 * self.margin)

    def _fit(self) -> None:
        points = self._later or self._first
        if not points:
            self.fixed = self.per_unit = 0.0
            return
        sizes = list(points)
        slope = 0.0
        self._spread = len(sizes) >= 2 and max(sizes) >= SPREAD * min(sizes)
        if self._spread:
            mean_s = sum(sizes) / len(sizes)
            mean_y = sum(points.values()) / len(sizes)
            var = sum((s - mean_s) ** 2 for s in sizes)
            slope = max(0.0, sum((s - mean_s) * (y - mean_y) for s, y in points.items()) / var)
        else:  # through the origin: an upper bound for any larger microbatch
            slope = max(y / s for s, y in points.items())
        fixed = max(0.0, max(y - slope * s for s, y in points.items()))
        self.per_unit, self.fixed = slope, fixed

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What the model measured, as plain values (the fit is recomputed from them).

        Example:
            >>> from elastic_batches.memory import MemoryModel
            >>> a = MemoryModel()
            >>> a.observe(4, 4000, first=False)
            >>> b = MemoryModel()
            >>> b.load_state_dict(a.state_dict())
            >>> b.per_unit
            1000.0
        """
        return {
            "version": _STATE_VERSION,
            "unit": self.unit,
            "base_margin": self.base_margin,
            "margin": self.margin,
            "retained": self.retained,
            "later": [[s, y] for s, y in self._later.items()],
            "first": [[s, y] for s, y in self._first.items()],
            "failures": [[s, y] for s, y in self._failures.items()],
            "kept": sorted(self._kept),
            "moved": [[s, origin] for s, origin in self._moved.items()],
            "wrong": self.wrong,
            "enabled": self.enabled,
            "calm": self.calm,
            "recover_after": self.recover_after,
            "probation": self.probation,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; every field is checked before any is applied.

        The margin restored is the larger of this model's own ``margin`` and the saved one.

        Raises:
            ValueError: a key is missing or unexpected, the version or unit differs, or a field
                has the wrong type or range (named); the model is then unchanged.
        """
        if state.get("version") == 1:  # written before the margin narrowed back: it starts calm
            check_state_dict("MemoryModel", state, _STATE_KEYS_V1, 1)
            state = {**state, "calm": 0, "recover_after": RECOVER_AFTER, "probation": False}
        elif state.get("version") == 2:  # written before failures of planned attempts were kept
            check_state_dict("MemoryModel", state, _STATE_KEYS_V2, 2)
        elif state.get("version") == 3:  # written before failures of measuring attempts moved up
            check_state_dict("MemoryModel", state, _STATE_KEYS_V3, 3)
        else:
            check_state_dict("MemoryModel", state, _STATE_KEYS, _STATE_VERSION)
        state = {"kept": [], "moved": [], **state}
        fields = StateFields("MemoryModel", state, source="MemoryModel.state_dict() (or SplitController.state_dict())")
        if state["unit"] != self.unit:
            raise fields.error("unit", f"{self.unit!r} (the controller's unit)")
        for key in ("base_margin", "margin"):
            fields.fraction(key, _MAX_MARGIN)
        fields.int("retained", low=0, allow_none=True)
        for key in ("later", "first", "failures"):
            pairs = state[key]
            if not isinstance(pairs, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and all(map(is_int, p)) and p[0] >= 1 and p[1] >= 0
                for p in pairs
            ):
                raise fields.error(key, "a list of [size >= 1, bytes >= 0] pairs")
        kept = state["kept"]
        failed = {pair[0] for pair in state["failures"]}
        if not isinstance(kept, (list, tuple)) or not all(is_int(s) and s in failed for s in kept):
            raise fields.error("kept", "a list of sizes in state['failures']")
        moved = state["moved"]
        if not isinstance(moved, (list, tuple)) or not all(
            isinstance(p, (list, tuple))
            and len(p) == 2
            and all(map(is_int, p))
            and p[0] in failed
            and p[0] not in kept
            and 1 <= p[1] < p[0]
            for p in moved
        ):
            raise fields.error("moved", "a list of [size in state['failures'] and not kept, 1 <= origin < size] pairs")
        for key, low in (("wrong", 0), ("calm", 0), ("recover_after", 1)):
            fields.int(key, low=low)
        fields.bool("enabled")
        fields.bool("probation")
        self.margin = max(self.base_margin, float(state["margin"]))
        self.retained = state["retained"]
        self._later = {s: y for s, y in state["later"]}
        self._first = {s: y for s, y in state["first"]}
        self._failures = {s: y for s, y in state["failures"]}
        self._kept = set(kept)
        self._moved = {s: origin for s, origin in moved}
        self.wrong = state["wrong"]
        self.enabled = state["enabled"]
        self.calm, self.recover_after, self.probation = state["calm"], state["recover_after"], state["probation"]
        self._fit()

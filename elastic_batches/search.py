"""``SizeSearch``: the OOM-driven search for the largest microbatch that fits.

The search learns in *microbatch sizes* (rows, or padded tokens, per microbatch), so that what
it learned on one batch size applies to another:

1. An OOM at size ``s`` with no size known to fit halves: the next size is ``ceil(s / 2)``.
2. Once a size fits and a larger one failed, each following step probes the middle of the
   interval ``[fits, fails)``, until ``fits >= 0.9 * (fails - 1)``: the settled size is then at
   least 90% of the largest that fits, and it never OOMs again while memory stays as it is.
3. With ``grow_after=N``, after ``N`` steps without OOM it probes one microbatch fewer; an OOM
   there falls back to the settled count, and the batch is retried, not lost. Each failed probe
   doubles the wait before the next (up to ``64 N``); a probe that succeeds resets it to ``N``.
4. An OOM at a size that fitted before means memory shrank: what fitted is forgotten and the
   search halves again from there.

A :class:`~elastic_batches.SplitController` holds one; it plans alone where nothing predicts
from measured memory, and plans the retry after an OOM beside the prediction.
"""

from __future__ import annotations

from elastic_batches.balance import BatchLoad
from elastic_batches.settled import SettledSplit

__all__ = ["SizeSearch"]


class SizeSearch:
    """The search's bounds and its growth probes.

    Args:
        grow_after: Steps without an OOM before a probe of one microbatch fewer (``None``: never).

    Attributes:
        fits: The largest size that completed a step (0: none yet).
        fails: The smallest size that ran out of memory (``None``: none yet).
        steps_since_oom: Steps completed since the last OOM (or the last growth probe).
        grow_pending: The next plan probes one microbatch fewer.
        grow_wait: Steps to wait before the next growth probe; doubles after a failed one.

    Example:
        >>> from elastic_batches import BatchLoad
        >>> from elastic_batches.search import SizeSearch
        >>> search = SizeSearch()
        >>> search.failed(64)
        >>> search.capacity()  # nothing fitted yet: half the failure
        32
        >>> search.succeeded(32), search.refining()  # 32 fits, 64 failed: probe between
        (True, True)
    """

    def __init__(self, grow_after: int | None = None) -> None:
        self.grow_after = grow_after
        self.fits = 0
        self.fails: int | None = None
        self.steps_since_oom = 0
        self.grow_pending = False
        self.grow_wait = grow_after

    def refining(self) -> bool:
        """Whether a size fitted and a larger one failed, more than 10% apart: the search probes between."""
        return bool(self.fits) and self.fails is not None and 10 * self.fits < 9 * (self.fails - 1)

    def capacity(self) -> int | None:
        """The largest microbatch a settled count keeps to; ``None``: no OOM known, no limit."""
        if self.fails is None:
            return None  # a success is a lower bound, never a ceiling
        if self.fits:
            return self.fits
        return max(1, (self.fails + 1) // 2)

    def count(self, load: BatchLoad, settled: SettledSplit, tag: int | None) -> int:
        """The search's count for a batch: the settled one, a probe between the bounds, or one fewer to grow."""
        count = settled.unclamped(load)
        if tag is not None and tag > count:
            return settled.clamp(load.rows, tag)
        if self.grow_pending:
            return settled.clamp(load.rows, max(count - 1, 1))
        if self.refining():
            assert self.fails is not None
            probe = load.count_within((self.fits + self.fails) // 2)
            if probe >= count:
                probe = count - 1
            if probe >= 1 and load.size_at(probe) < self.fails:  # a count strictly between fits and fails
                count = probe
        return settled.clamp(load.rows, max(count, 1))

    def succeeded(self, size: int) -> bool:
        """A step whose largest microbatch was ``size`` completed; whether the bounds changed."""
        if self.grow_pending and size > self.fits and self.grow_after is not None:
            self.grow_wait = self.grow_after  # a growth probe succeeded: probe at the base rate again
        fits, fails = max(self.fits, size), self.fails
        if fails is not None and fits >= fails:
            # Memory grew past an old failure (or that failure was at the edge): it moves to just above what
            # fitted, so a larger microbatch waits for a growth probe instead of being tried on every batch.
            fails = fits + 1
        self.grow_pending = False
        self.steps_since_oom += 1
        changed = (fits, fails) != (self.fits, self.fails)
        self.fits, self.fails = fits, fails
        return changed

    def schedule_growth(self, count: int, *, predicting: bool) -> None:
        """After a success at ``count`` microbatches: probe one fewer once ``grow_wait`` steps passed.

        Predicting, memory that grows back is seen without a probe.
        """
        if predicting or self.grow_wait is None or count <= 1:
            return
        if self.steps_since_oom >= self.grow_wait:
            self.grow_pending = True
            self.steps_since_oom = 0

    def interrupted(self) -> None:
        """An OOM: a growth probe that was pending failed (the wait doubles), and the steps count from 0."""
        if self.grow_pending and self.grow_wait is not None and self.grow_after is not None:
            self.grow_wait = min(2 * self.grow_wait, 64 * self.grow_after)  # back off: memory did not grow
        self.grow_pending = False
        self.steps_since_oom = 0

    def failed(self, size: int) -> None:
        """A step whose largest microbatch was ``size`` ran out of memory (after :meth:`interrupted`)."""
        self.fails = size if self.fails is None else min(self.fails, size)
        if self.fits >= size:
            self.fits = 0  # an OOM at a size that fitted: memory shrank

    def forget(self) -> None:
        """Forget which sizes fitted and failed (the memory they were measured under changed)."""
        self.fits, self.fails = 0, None
        self.grow_pending = False

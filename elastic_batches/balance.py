"""``BatchLoad``: how a batch is cut into contiguous pieces, and what its largest piece costs.

The :class:`SplitController` learns a *capacity*: the cost of the largest microbatch that fits.
A ``BatchLoad`` turns a capacity into a count for one batch (:meth:`BatchLoad.count_within`), a
count into the cost of its largest piece (:meth:`BatchLoad.size_at`) and into the pieces
themselves (:meth:`BatchLoad.sizes`); :meth:`ElasticBatch.microbatches` cuts along the same
pieces. Two units:

- ``rows`` (the default): a piece costs its rows. Pieces are balanced by rows (10 rows in 3:
  4, 3, 3), and ``count_within(c) = ceil(rows / c)``.
- ``tokens``: a piece costs its *padded positions*, its rows times its longest sample, which is
  what a microbatch padded to its own longest sample holds. Pieces are contiguous (the loader
  sorts samples by length), the largest piece is as small as any ``k``-piece cut allows, and
  within that bound the pieces carry similar numbers of real tokens.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Sequence
from itertools import accumulate

from elastic_batches._state import is_int

__all__ = ["BatchLoad", "rows_within", "split_sizes"]


def split_sizes(batch_size: int, split_count: int) -> list[int]:
    """Row counts of a balanced split: ``batch_size`` rows in ``split_count`` pieces.

    The first ``batch_size % split_count`` pieces get one row more, as ``torch.tensor_split``
    does; pieces never differ by more than one row.

    Example:
        >>> from elastic_batches.balance import split_sizes
        >>> split_sizes(10, 3)
        [4, 3, 3]
    """
    base, extra = divmod(batch_size, split_count)
    return [base + 1] * extra + [base] * (split_count - extra)


def rows_within(rows: int, capacity: int) -> int:
    """The fewest pieces of at most ``capacity`` rows that ``rows`` rows cut into (at most ``rows``).

    Example:
        >>> from elastic_batches.balance import rows_within
        >>> rows_within(10, 4), rows_within(10, 0)
        (3, 10)
    """
    return min(rows, -(-rows // max(1, capacity)))


class BatchLoad:
    """The rows of one batch and, in the ``tokens`` unit, each row's length.

    Args:
        rows: The batch's rows (at least 1).
        lengths: Each row's length in batch order (its longest padded field), or ``None`` for the
            ``rows`` unit. A length below 1 counts as 1: every row takes a place.

    Raises:
        ValueError: ``rows`` is not a positive int, or ``lengths`` does not hold ``rows`` values.

    Example:
        >>> from elastic_batches import BatchLoad
        >>> load = BatchLoad(6, lengths=[8, 8, 4, 4, 2, 2])  # sorted longest first
        >>> load.unit, load.size_at(1)  # one piece: 6 rows padded to 8
        ('tokens', 48)
        >>> load.count_within(16), load.sizes(2), [load.cost(0, 2), load.cost(2, 6)]
        (2, [2, 4], [16, 16])
        >>> BatchLoad(10).sizes(3), BatchLoad(10).count_within(4)
        ([4, 3, 3], 3)
    """

    def __init__(self, rows: int, lengths: Sequence[int] | None = None) -> None:
        if not is_int(rows) or rows < 1:
            raise ValueError(f"BatchLoad: rows must be an int >= 1, got {rows!r}")
        self.rows = rows
        self.lengths: tuple[int, ...] | None = None
        if lengths is not None:
            self.lengths = tuple(max(1, int(length)) for length in lengths)
            if len(self.lengths) != rows:
                raise ValueError(f"BatchLoad: {len(self.lengths)} lengths given for {rows} rows; give one per row")
            self._descending = all(a >= b for a, b in zip(self.lengths, self.lengths[1:], strict=False))
            self._tokens = [0, *accumulate(self.lengths)]
        self._size_at: dict[int, int] = {}

    @property
    def unit(self) -> str:
        """``"rows"`` or ``"tokens"``: what a piece's cost counts."""
        return "rows" if self.lengths is None else "tokens"

    def __repr__(self) -> str:
        if self.lengths is None:
            return f"BatchLoad(rows={self.rows})"
        return f"BatchLoad(rows={self.rows}, longest={max(self.lengths)}, tokens={self._tokens[-1]})"

    def tail(self, start: int) -> BatchLoad:
        """The load of rows ``start:`` (``start`` below ``rows``).

        Example:
            >>> from elastic_batches import BatchLoad
            >>> BatchLoad(4, [9, 5, 3, 1]).tail(1).lengths
            (5, 3, 1)
        """
        return BatchLoad(self.rows - start, None if self.lengths is None else self.lengths[start:])

    def cost(self, start: int, stop: int) -> int:
        """The cost of rows ``start:stop`` as one piece: rows, or rows times the longest length."""
        if self.lengths is None:
            return stop - start
        return (stop - start) * max(self.lengths[start:stop], default=0)

    def count_within(self, capacity: int) -> int:
        """The fewest pieces whose costs are all at most ``capacity``.

        Returns ``rows`` when even one row alone costs more than ``capacity`` (the batch cannot be
        cut finer than one row per piece).
        """
        capacity = max(1, int(capacity))
        if self.lengths is None:
            return rows_within(self.rows, capacity)
        if capacity < max(self.lengths):
            return self.rows
        if self._descending:  # a piece's first row is its longest
            count, start = 0, 0
            while start < self.rows:
                start += capacity // self.lengths[start]
                count += 1
            return count
        ends = self._ends(capacity)
        count, start = 0, 0
        while start < self.rows:
            start = ends[start]
            count += 1
        return count

    def size_at(self, count: int) -> int:
        """The cost of the largest piece of :meth:`sizes` ``(count)``: the smallest any cut into
        ``count`` contiguous pieces allows (``count`` is capped at ``rows``)."""
        count = max(1, min(int(count), self.rows))
        if self.lengths is None:
            return math.ceil(self.rows / count)
        cached = self._size_at.get(count)
        if cached is not None:
            return cached
        low, high = max(self.lengths), self.cost(0, self.rows)
        while low < high:  # the cheapest capacity that count pieces can keep to
            middle = (low + high) // 2
            if self.count_within(middle) <= count:
                high = middle
            else:
                low = middle + 1
        self._size_at[count] = low
        return low

    def sizes(self, count: int, *, min_rows: int = 1) -> list[int]:
        """The rows of each of ``count`` contiguous pieces (``count`` capped at ``rows``).

        ``rows`` unit: balanced rows. ``tokens`` unit: no piece costs more than
        :meth:`size_at` ``(count)``, and within that bound each piece takes the real tokens
        closest to an equal share of what is left. With ``min_rows``, no piece has fewer rows
        (``count`` is then at most ``rows // min_rows``): a piece that would is widened into its
        neighbours, which may make the largest piece cost more (:meth:`largest`).

        Example:
            >>> from elastic_batches import BatchLoad
            >>> load = BatchLoad(6, lengths=[100, 10, 10, 10, 10, 10])
            >>> load.sizes(2), load.sizes(2, min_rows=3)
            ([1, 5], [3, 3])
        """
        count = max(1, min(int(count), self.rows, self.rows // max(1, min_rows)))
        if self.lengths is None:
            return split_sizes(self.rows, count)
        sizes = self._token_sizes(count)
        return sizes if min(sizes) >= min_rows else _at_least(sizes, min_rows)

    def largest(self, sizes: Sequence[int]) -> int:
        """The cost of the largest piece of a cut into pieces of ``sizes`` rows (in batch order).

        Example:
            >>> from elastic_batches import BatchLoad
            >>> BatchLoad(6, lengths=[100, 10, 10, 10, 10, 10]).largest([3, 3])
            300
        """
        costs, start = [], 0
        for rows in sizes:
            costs.append(self.cost(start, start + rows))
            start += rows
        return max(costs)

    def _token_sizes(self, count: int) -> list[int]:
        """The tokens unit's cut into ``count`` pieces (see :meth:`sizes`)."""
        capacity = self.size_at(count)
        ends = self._ends(capacity)
        needed = [0] * (self.rows + 1)  # fewest pieces that cover rows[i:] within capacity
        for i in range(self.rows - 1, -1, -1):
            needed[i] = 1 + needed[ends[i]]
        tokens = self._tokens
        sizes = []
        start = 0
        for left in range(count, 0, -1):
            if left == 1:
                sizes.append(self.rows - start)
                break
            # feasible ends: the rest still fits in left - 1 pieces, and leaves a row for each
            low = start + 1
            while needed[low] > left - 1:
                low += 1
            high = min(ends[start], self.rows - (left - 1))
            share = tokens[start] + (tokens[-1] - tokens[start]) / left
            stop = bisect.bisect_left(tokens, share, low, high + 1)
            if stop > high or (stop > low and share - tokens[stop - 1] <= tokens[stop] - share):
                stop -= 1
            sizes.append(stop - start)
            start = stop
        return sizes

    def _ends(self, capacity: int) -> list[int]:
        """For each row ``i``, the end of the longest piece starting at ``i`` within ``capacity``."""
        assert self.lengths is not None
        lengths, rows = self.lengths, self.rows
        ends = [0] * rows
        window: collections.deque[int] = collections.deque()  # indices of decreasing lengths in [i, stop)
        stop = 0
        for i in range(rows):
            while window and window[0] < i:
                window.popleft()
            stop = max(stop, i)
            while stop < rows:
                longest = max(lengths[window[0]] if window else 0, lengths[stop])
                if (stop + 1 - i) * longest > capacity:
                    break
                while window and lengths[window[-1]] <= lengths[stop]:
                    window.pop()
                window.append(stop)
                stop += 1
            ends[i] = stop
        return ends


def _at_least(sizes: list[int], min_rows: int) -> list[int]:
    """``sizes`` with every piece widened to ``min_rows`` rows, the boundaries moved as little as that takes.

    The boundaries move right where a piece is too short, then left where the pieces after one
    are, so that the count stays (it is at most ``sum(sizes) // min_rows``).
    """
    ends = list(accumulate(sizes))
    for i in range(len(ends) - 1):
        ends[i] = max(ends[i], (ends[i - 1] if i else 0) + min_rows)
    for i in range(len(ends) - 2, -1, -1):
        ends[i] = min(ends[i], ends[i + 1] - min_rows)
    return [stop - start for start, stop in zip([0, *ends[:-1]], ends, strict=True)]

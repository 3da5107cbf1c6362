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
  within that bound the pieces carry similar numbers of real tokens
  (:class:`~elastic_batches.variable_length.tokens.TokenLengths` does that arithmetic).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from elastic_batches._state import is_int
from elastic_batches.variable_length.tokens import TokenLengths

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
        self._tokens: TokenLengths | None = None
        if lengths is not None:
            self.lengths = tuple(max(1, int(length)) for length in lengths)
            if len(self.lengths) != rows:
                raise ValueError(f"BatchLoad: {len(self.lengths)} lengths given for {rows} rows; give one per row")
            self._tokens = TokenLengths(self.lengths)

    @property
    def unit(self) -> str:
        """``"rows"`` or ``"tokens"``: what a piece's cost counts."""
        return "rows" if self.lengths is None else "tokens"

    def __repr__(self) -> str:
        if self.lengths is None:
            return f"BatchLoad(rows={self.rows})"
        assert self._tokens is not None
        return f"BatchLoad(rows={self.rows}, longest={max(self.lengths)}, tokens={self._tokens.tokens[-1]})"

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
        if self._tokens is None:
            return stop - start
        return self._tokens.cost(start, stop)

    def count_within(self, capacity: int) -> int:
        """The fewest pieces whose costs are all at most ``capacity``.

        Returns ``rows`` when even one row alone costs more than ``capacity`` (the batch cannot be
        cut finer than one row per piece).
        """
        capacity = max(1, int(capacity))
        if self._tokens is None:
            return rows_within(self.rows, capacity)
        return self._tokens.count_within(capacity)

    def size_at(self, count: int) -> int:
        """The cost of the largest piece of :meth:`sizes` ``(count)``: the smallest any cut into
        ``count`` contiguous pieces allows (``count`` is capped at ``rows``)."""
        count = max(1, min(int(count), self.rows))
        if self._tokens is None:
            return math.ceil(self.rows / count)
        return self._tokens.size_at(count)

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
        if self._tokens is None:
            return split_sizes(self.rows, count)
        return self._tokens.sizes(count, min_rows=min_rows)

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

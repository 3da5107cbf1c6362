"""The tokens unit's arithmetic: rows of known lengths cut into contiguous pieces of bounded padded positions.

A piece padded to its own longest row holds its rows times that length; :class:`TokenLengths`
finds the fewest pieces within a capacity, the smallest capacity a count of pieces allows, and
the cut itself, with the pieces' real tokens as even as that bound lets them be.
:class:`~elastic_batches.BatchLoad` holds one for a batch measured in tokens.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Sequence
from itertools import accumulate

__all__ = ["TokenLengths"]


class TokenLengths:
    """Each row's length (at least 1) in batch order.

    Example:
        >>> from elastic_batches.variable_length.tokens import TokenLengths
        >>> lengths = TokenLengths([8, 8, 4, 4, 2, 2])
        >>> lengths.count_within(16), lengths.size_at(2), lengths.sizes(2)
        (2, 16, [2, 4])
    """

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = tuple(lengths)
        self.rows = len(self.lengths)
        self.tokens = [0, *accumulate(self.lengths)]  # tokens[i]: the real tokens of rows [0, i)
        self._descending = all(a >= b for a, b in zip(self.lengths, self.lengths[1:], strict=False))
        self._size_at: dict[int, int] = {}

    def cost(self, start: int, stop: int) -> int:
        """The padded positions of rows ``start:stop`` as one piece: rows times the longest length."""
        return (stop - start) * max(self.lengths[start:stop], default=0)

    def count_within(self, capacity: int) -> int:
        """The fewest pieces whose costs are all at most ``capacity`` (``rows`` if one row alone costs more)."""
        if capacity < max(self.lengths):
            return self.rows
        count, start = 0, 0
        if self._descending:  # a piece's first row is its longest
            while start < self.rows:
                start += capacity // self.lengths[start]
                count += 1
            return count
        ends = self.ends(capacity)
        while start < self.rows:
            start = ends[start]
            count += 1
        return count

    def size_at(self, count: int) -> int:
        """The smallest capacity that ``count`` contiguous pieces (``1 <= count <= rows``) can keep to."""
        cached = self._size_at.get(count)
        if cached is not None:
            return cached
        low, high = max(self.lengths), self.cost(0, self.rows)
        while low < high:
            middle = (low + high) // 2
            if self.count_within(middle) <= count:
                high = middle
            else:
                low = middle + 1
        self._size_at[count] = low
        return low

    def sizes(self, count: int, *, min_rows: int = 1) -> list[int]:
        """The rows of each of ``count`` pieces within :meth:`size_at` ``(count)``, each piece's real tokens
        closest to an equal share of what is left; widened to ``min_rows`` rows a piece where one is shorter
        (``count`` at most ``rows // min_rows``)."""
        capacity = self.size_at(count)
        ends = self.ends(capacity)
        needed = [0] * (self.rows + 1)  # fewest pieces that cover rows[i:] within capacity
        for i in range(self.rows - 1, -1, -1):
            needed[i] = 1 + needed[ends[i]]
        tokens = self.tokens
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
        return sizes if min(sizes) >= min_rows else _at_least(sizes, min_rows)

    def ends(self, capacity: int) -> list[int]:
        """For each row ``i``, the end of the longest piece starting at ``i`` within ``capacity``."""
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

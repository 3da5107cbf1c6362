"""``ShapeBuckets``: keep microbatch shapes in a few buckets, so a compiled model recompiles rarely.

``torch.compile`` specialises a graph on the shapes it sees (always with ``dynamic=False``, and
for CUDA graphs); every new microbatch shape compiles again. Padded lengths vary from batch to
batch and row counts from split to split, so shapes are rounded up into buckets: lengths (and
optionally rows) to a multiple of a number or to the next power of two.

Rounding lengths up is always exact: the added positions hold the field's pad value, as the
padding of any shorter sample does. Rounding rows up adds whole rows of pad values (length 0);
that is exact only when the loss ignores such rows: every field of the batch must then have a
pad value, the labels' pad value must be the ignore index, and ``ElasticStep.backward`` must get
a ``count_fn`` that counts nothing in them (rows-weighted losses would average pad rows in).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from elastic_batches._state import is_int

__all__ = ["ShapeBuckets"]

Rounding = int | Literal["pow2"] | None


def _check(name: str, value: object) -> None:
    if value is None or value == "pow2":
        return
    if not is_int(value) or value < 1:
        raise ValueError(f"ShapeBuckets: {name} must be an int >= 1 (a multiple), 'pow2' or None, got {value!r}")


def _round(value: int, rounding: Rounding) -> int:
    if rounding is None:
        return value
    value = max(value, 1)
    if rounding == "pow2":
        return 1 << (value - 1).bit_length()
    return math.ceil(value / rounding) * rounding


@dataclasses.dataclass(frozen=True)
class ShapeBuckets:
    """How microbatch shapes are rounded up: padded lengths, and optionally rows.

    Give it to ``MicrobatchingDataLoader(..., pad_values=..., shape_buckets=...)``. Each
    microbatch is then padded to ``round_length(its longest sample)`` positions in every padded
    field and, with ``rows``, to ``round_rows(its rows)`` rows. A compiled model then sees at most
    ``len(length buckets) * len(row buckets)`` shapes.

    Args:
        lengths: ``"pow2"`` (default): the next power of two; an int ``m``: the next multiple of
            ``m``; ``None``: each microbatch's own longest sample.
        rows: The same for the row count; ``None`` (default) keeps the rows. Rows are padded with
            samples that hold only pad values: exact only with a loss that ignores them and a
            ``count_fn`` (see the module docs).

    Raises:
        ValueError: a rounding is neither a positive int, ``"pow2"`` nor ``None``.

    Example:
        >>> from elastic_batches import ShapeBuckets
        >>> buckets = ShapeBuckets(lengths="pow2", rows=8)
        >>> buckets.round_length(100), buckets.round_length(128), buckets.round_rows(13)
        (128, 128, 16)
        >>> ShapeBuckets(lengths=64).round_length(65), ShapeBuckets().round_rows(13)
        (128, 13)
    """

    lengths: Rounding = "pow2"
    rows: Rounding = None

    def __post_init__(self) -> None:
        _check("lengths", self.lengths)
        _check("rows", self.rows)

    def round_length(self, length: int) -> int:
        """The padded length of a microbatch whose longest sample has ``length`` positions."""
        return _round(length, self.lengths)

    def round_rows(self, rows: int) -> int:
        """The row count of a microbatch of ``rows`` samples (pad rows included)."""
        return _round(rows, self.rows)

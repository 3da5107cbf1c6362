"""``ElasticBatch``, the batch a ``MicrobatchingDataLoader`` yields, and its ``Microbatch``es."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDictBase

from elastic_batches.balance import BatchLoad, split_sizes
from elastic_batches.structures import BatchSpec, from_tensordict, map_constants, to_tensordict

if TYPE_CHECKING:
    from elastic_batches.padding import Padding

__all__ = ["ElasticBatch", "Microbatch", "split_sizes"]


@dataclasses.dataclass(frozen=True)
class Microbatch:
    """One piece of an :class:`ElasticBatch`.

    Attributes:
        data: The microbatch's rows of the batch's fields (a ``TensorDict``).
        weight: The share of the batch's mean loss this microbatch carries: its rows divided by
            the batch's rows (or its counted items divided by the batch's, see ``count_fn`` of
            :meth:`ElasticStep.backward`). The weights of a batch sum to 1.
        index: Position of the microbatch in the split, from 0.
        count: Number of microbatches in the split.

    Example:
        >>> import torch
        >>> from elastic_batches import ElasticBatch
        >>> mb = next(ElasticBatch.wrap({"x": torch.arange(10)}).microbatches(3))
        >>> mb.index, mb.count, mb.weight, mb.unwrap()["x"].tolist()
        (0, 3, 0.4, [0, 1, 2, 3])
    """

    data: TensorDictBase
    weight: float
    index: int
    count: int
    spec: BatchSpec = dataclasses.field(repr=False)

    def __len__(self) -> int:
        return int(self.data.batch_size[0])

    def unwrap(self) -> Any:
        """The microbatch in the user's own structure (what the plain DataLoader yields, cut to these rows)."""
        return from_tensordict(self.data, self.spec)

    def to(self, device: torch.device | str | int, *, non_blocking: bool = False) -> Microbatch:
        """A copy of the microbatch on ``device`` (fields and broadcast tensors)."""
        spec = map_constants(self.spec, lambda t: t.to(device, non_blocking=non_blocking))
        return dataclasses.replace(self, data=self.data.to(device, non_blocking=non_blocking), spec=spec)


class ElasticBatch:
    """A batch taken apart into row-splittable fields, tagged with the split count to use.

    Args:
        data: The batch's fields, a ``TensorDict`` with ``batch_size=[B]``.
        spec: How to rebuild the user's structure around ``data`` (from
            :func:`elastic_batches.structures.to_tensordict`).
        split_count: How many microbatches the batch should be cut into; the loader sets it when
            it yields the batch, and the step side uses the larger of it and its controller's.
        padding: Which fields are padded and each sample's lengths (set by the loader when it
            has ``pad_values``); each microbatch's padded fields are then cut to its own longest
            sample. ``None``: fields are cut by rows only.

    Example:
        >>> import torch
        >>> from elastic_batches import ElasticBatch
        >>> batch = ElasticBatch.wrap((torch.randn(10, 3), torch.arange(10)), split_count=3)
        >>> len(batch), batch.split_count
        (10, 3)
        >>> [len(mb) for mb in batch.microbatches()]
        [4, 3, 3]
        >>> type(batch.unwrap())
        <class 'tuple'>
    """

    def __init__(
        self, data: TensorDictBase, spec: BatchSpec, split_count: int = 1, padding: Padding | None = None
    ) -> None:
        if not isinstance(data, TensorDictBase) or data.batch_dims < 1:
            raise TypeError(f"ElasticBatch expects a TensorDict with batch_size=[B] as data, got {data!r}")
        self.data = data
        self.spec = spec
        self.split_count = split_count
        self.padding = padding
        self._loads: dict[str, BatchLoad] = {}

    @classmethod
    def wrap(cls, batch: Any, split_count: int = 1) -> ElasticBatch:
        """Take any supported batch structure apart; an ``ElasticBatch`` is returned as it is.

        Raises:
            TypeError: a part of the batch cannot be split (names the type and ``register_batch_type``).
            ValueError: fields disagree on the batch size (names the fields and their sizes).
        """
        if isinstance(batch, ElasticBatch):
            return batch
        data, spec = to_tensordict(batch)
        return cls(data, spec, split_count)

    @property
    def split_count(self) -> int:
        """The number of microbatches this batch was tagged with (at least 1)."""
        return self._split_count

    @split_count.setter
    def split_count(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"ElasticBatch.split_count must be an int >= 1, got {value!r}")
        self._split_count = value

    def __len__(self) -> int:
        return int(self.data.batch_size[0])

    def __repr__(self) -> str:
        return f"ElasticBatch(rows={len(self)}, split_count={self.split_count}, fields={sorted(self.data.keys())})"

    def unwrap(self) -> Any:
        """The whole batch in the user's own structure."""
        return from_tensordict(self.data, self.spec)

    def to(self, device: torch.device | str | int, *, non_blocking: bool = False) -> ElasticBatch:
        """A copy of the batch on ``device`` (fields and broadcast tensors); the tag is kept."""
        spec = map_constants(self.spec, lambda t: t.to(device, non_blocking=non_blocking))
        return ElasticBatch(self.data.to(device, non_blocking=non_blocking), spec, self.split_count, self.padding)

    def pin_memory(self) -> ElasticBatch:
        """A copy in page-locked memory (called by the DataLoader's pin-memory thread)."""
        return ElasticBatch(self.data.pin_memory(), self.spec, self.split_count, self.padding)

    def load(self, unit: str = "rows") -> BatchLoad:
        """The batch's :class:`BatchLoad` in ``unit``: what a :class:`SplitController` plans with.

        Args:
            unit: ``"rows"``, or ``"tokens"`` (padded positions; needs a padded batch).

        Raises:
            ValueError: ``unit`` is unknown, or ``"tokens"`` for a batch without padded fields.

        Example:
            >>> import torch
            >>> import elastic_batches as eb
            >>> samples = [{"ids": torch.ones(n, dtype=torch.long)} for n in (2, 7, 3)]
            >>> batch = eb.ElasticCollate(pad_values={"ids": 0})(samples)
            >>> batch.load("tokens").lengths, batch.load("tokens").size_at(1)
            ((7, 3, 2), 21)
        """
        load = self._loads.get(unit)
        if load is not None:
            return load
        if unit == "rows":
            load = BatchLoad(len(self))
        elif unit == "tokens":
            if self.padding is None:
                raise ValueError(
                    "a tokens-based split needs a batch with padded fields: give the MicrobatchingDataLoader "
                    "pad_values={field: pad value}, or use SplitController(unit='rows')"
                )
            load = BatchLoad(len(self), self.padding.row_lengths())
        else:
            raise ValueError(f"ElasticBatch.load: unit must be 'rows' or 'tokens', got {unit!r}")
        self._loads[unit] = load
        return load

    def microbatches(self, split_count: int | None = None, *, balance: str = "rows") -> Iterator[Microbatch]:
        """Cut the batch into microbatches of consecutive rows.

        A padded batch's microbatches hold their padded fields cut to their own longest sample
        (rounded up by the padding's ``ShapeBuckets``, if any).

        Args:
            split_count: Number of pieces; defaults to the batch's tag. More pieces than rows
                is not possible: it is capped at the number of rows.
            balance: ``"rows"`` (default): pieces differ by at most one row. ``"tokens"``: the
                largest piece's padded positions are as few as the count allows and the pieces
                carry similar token counts (see :class:`BatchLoad`); needs a padded batch.

        Yields:
            :class:`Microbatch` objects whose weights (rows / batch rows) sum to 1.

        Raises:
            ValueError: the batch is empty, or ``split_count`` is not a positive int.
        """
        rows = len(self)
        if rows == 0:
            raise ValueError("cannot split an empty batch (0 rows): check the DataLoader's sampler and dataset")
        count = self.split_count if split_count is None else split_count
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"split_count must be an int >= 1, got {count!r}")
        count = min(count, rows)
        sizes = split_sizes(rows, count) if balance == "rows" else self.load(balance).sizes(count)
        start = 0
        for index, size in enumerate(sizes):
            stop = start + size
            if self.padding is not None:
                data = self.padding.piece(self.data, start, stop)
            else:
                data = self.data if size == rows else self.data[start:stop]  # a whole batch needs no slicing
            yield Microbatch(data, size / rows, index, count, self.spec)
            start = stop

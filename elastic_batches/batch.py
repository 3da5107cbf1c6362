"""``ElasticBatch``, the batch a ``MicrobatchingDataLoader`` yields, and its ``Microbatch``es."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from tensordict import TensorDictBase

from elastic_batches.structures import BatchSpec, from_tensordict, map_constants, to_tensordict

__all__ = ["ElasticBatch", "Microbatch", "split_sizes"]


def split_sizes(batch_size: int, split_count: int) -> list[int]:
    """Row counts of a balanced split: ``batch_size`` rows in ``split_count`` pieces.

    The first ``batch_size % split_count`` pieces get one row more, as ``torch.tensor_split``
    does; pieces never differ by more than one row.

    Example:
        >>> from elastic_batches.batch import split_sizes
        >>> split_sizes(10, 3)
        [4, 3, 3]
    """
    base, extra = divmod(batch_size, split_count)
    return [base + 1] * extra + [base] * (split_count - extra)


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

    def __init__(self, data: TensorDictBase, spec: BatchSpec, split_count: int = 1) -> None:
        if not isinstance(data, TensorDictBase) or data.batch_dims < 1:
            raise TypeError(f"ElasticBatch expects a TensorDict with batch_size=[B] as data, got {data!r}")
        self.data = data
        self.spec = spec
        self.split_count = split_count

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
        return ElasticBatch(self.data.to(device, non_blocking=non_blocking), spec, self.split_count)

    def pin_memory(self) -> ElasticBatch:
        """A copy in page-locked memory (called by the DataLoader's pin-memory thread)."""
        return ElasticBatch(self.data.pin_memory(), self.spec, self.split_count)

    def microbatches(self, split_count: int | None = None) -> Iterator[Microbatch]:
        """Cut the batch into balanced microbatches, in row order.

        Args:
            split_count: Number of pieces; defaults to the batch's tag. More pieces than rows
                is not possible: it is capped at the number of rows.

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
        start = 0
        for index, size in enumerate(split_sizes(rows, count)):
            yield Microbatch(self.data[start : start + size], size / rows, index, count, self.spec)
            start += size

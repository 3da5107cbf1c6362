"""``ElasticBatch``, the batch a ``MicrobatchingDataLoader`` yields, and its ``Microbatch``es.

A batch holds its *fields* (:data:`elastic_batches.structures.Fields`: a flat ``dict`` of tensors
and per-sample lists, all with the batch's rows first) and the spec that rebuilds the user's
structure around them. Microbatches slice the fields directly; the ``TensorDict`` that ``.data``
shows is built only when it is read. A batch from the loader keeps the user's object as it is
(it crosses from a worker as the plain loader's batch would) and is taken apart on first use,
so that iterating the loader costs next to nothing over the loader it wraps.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from tensordict import NonTensorStack, TensorDictBase

from elastic_batches._state import is_int
from elastic_batches.balance import BatchLoad, split_sizes
from elastic_batches.structures import (
    BatchSpec,
    Fields,
    as_tensordict,
    flatten,
    leading_rows,
    map_constants,
    rebuild,
    slice_fields,
    split_fields,
)

if TYPE_CHECKING:
    from elastic_batches.settled import SettledSplit
    from elastic_batches.variable_length.padding import Padding

__all__ = ["ElasticBatch", "Microbatch", "split_sizes"]

_NO_SOURCE: Any = object()  # the user's object is not kept (a batch moved, padded or built from fields)


def _moved(fields: Fields, move: Any, device: torch.device | str | int | None = None) -> Fields:
    """Tensors moved by ``move``; with ``device``, per-sample objects that have ``.to`` (PyG ``Data``) too."""
    return {
        key: (value if device is None else _moved_objects(value, device)) if type(value) is list else move(value)
        for key, value in fields.items()
    }


def _moved_objects(objects: list[Any], device: torch.device | str | int) -> list[Any]:
    if not any(callable(getattr(item, "to", None)) for item in objects):
        return objects  # strings, ids, dicts of metadata: nothing to move
    # a copy is moved: PyG's Data.to moves the object itself, which would leave the user's dataset on the device
    return [copy.copy(item).to(device) if callable(getattr(item, "to", None)) else item for item in objects]


class Microbatch:
    """One piece of an :class:`ElasticBatch`.

    Attributes:
        fields: The microbatch's rows of the batch's flat fields (a ``dict``; see :attr:`data`).
        weight: The share of the batch's mean loss this microbatch carries: its rows divided by
            the batch's rows (or its counted items divided by the batch's, see ``count_fn`` of
            :meth:`ElasticStep.backward`). The weights of a batch sum to 1.
        index: Position of the microbatch in the split, from 0.
        count: Number of microbatches in the split. While a batch's memory is measured (a
            first, small microbatch, the rest cut one at a time; ``SplitController(margin=...)``
            with a memory probe), the count known so far, at least ``index + 2`` before the
            last; every microbatch holds the final count when the attempt ends. ``count > 1``
            says the batch is split either way.
        spec: How the user's structure is rebuilt around ``fields``.

    Example:
        >>> import torch
        >>> from elastic_batches import ElasticBatch
        >>> mb = next(ElasticBatch.wrap({"x": torch.arange(10)}).microbatches(3))
        >>> mb.index, mb.count, mb.weight, mb.unwrap()["x"].tolist()
        (0, 3, 0.4, [0, 1, 2, 3])
        >>> mb
        Microbatch(rows=4, weight=0.4, index=0, count=3)
    """

    __slots__ = ("_data", "_source", "count", "fields", "index", "spec", "weight")

    def __init__(
        self, fields: Fields, weight: float, index: int, count: int, spec: BatchSpec, source: Any = _NO_SOURCE
    ) -> None:
        self.fields = fields
        self.weight = weight
        self.index = index
        self.count = count
        self.spec = spec
        self._source = source  # the user's object, for a whole batch
        self._data: TensorDictBase | None = None

    def __len__(self) -> int:
        return len(next(iter(self.fields.values())))

    def __repr__(self) -> str:
        return f"Microbatch(rows={len(self)}, weight={self.weight}, index={self.index}, count={self.count})"

    @property
    def data(self) -> TensorDictBase:
        """The microbatch's fields as a ``TensorDict`` with ``batch_size=[rows]`` (built on first read)."""
        if self._data is None:
            self._data = as_tensordict(self.fields, len(self))
        return self._data

    def reweighted(self, weight: float) -> Microbatch:
        """The same rows with another weight."""
        return Microbatch(self.fields, weight, self.index, self.count, self.spec, self._source)

    def unwrap(self) -> Any:
        """The microbatch in the user's own structure (what the plain DataLoader yields, cut to these rows)."""
        if self._source is not _NO_SOURCE:
            return self._source
        return rebuild(self.fields, self.spec)

    def to(self, device: torch.device | str | int, *, non_blocking: bool = False) -> Microbatch:
        """A copy of the microbatch on ``device``.

        Tensors, broadcast tensors, and per-sample objects that have a ``.to`` method (a list of
        PyG ``Data``: ``item.to(device)``) are moved; other per-sample values are kept as they are.
        """

        def move(t: Any) -> Any:
            return t.to(device, non_blocking=non_blocking)

        return Microbatch(
            _moved(self.fields, move, device), self.weight, self.index, self.count, map_constants(self.spec, move)
        )


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

    __slots__ = ("_data", "_fields", "_loads", "_rows", "_settled", "_source", "_spec", "_split_count", "padding")

    _data: TensorDictBase | None
    _split_count: int | None  # None: worked out from _settled when first read

    def __init__(
        self, data: TensorDictBase, spec: BatchSpec, split_count: int = 1, padding: Padding | None = None
    ) -> None:
        if not isinstance(data, TensorDictBase) or data.batch_dims < 1:
            raise TypeError(f"ElasticBatch expects a TensorDict with batch_size=[B] as data, got {data!r}")
        fields = {key: value.tolist() if isinstance(value, NonTensorStack) else value for key, value in data.items()}
        self._set(fields, spec, int(data.batch_size[0]), split_count, padding, _NO_SOURCE)
        self._data = data

    def _set(
        self,
        fields: Fields | None,
        spec: BatchSpec | None,
        rows: int | None,
        split_count: int,
        padding: Padding | None,
        source: Any,
    ) -> None:
        self._fields = fields
        self._spec = spec
        self._rows = rows
        self._source = source
        self._data = None
        self.split_count = split_count
        self._settled: SettledSplit | None = None
        self.padding = padding
        self._loads: dict[str, BatchLoad] = {}

    @classmethod
    def from_fields(
        cls, fields: Fields, spec: BatchSpec, *, split_count: int = 1, padding: Padding | None = None
    ) -> ElasticBatch:
        """A batch of flat fields (from :func:`elastic_batches.structures.flatten`).

        Raises:
            ValueError: ``fields`` is empty, or its values disagree on the rows.
        """
        sizes = {key: len(value) for key, value in fields.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(
                f"ElasticBatch.from_fields: fields must all have the same rows (first dimension), got {sizes}"
            )
        batch = cls.__new__(cls)
        batch._set(fields, spec, next(iter(sizes.values())), split_count, padding, _NO_SOURCE)
        return batch

    @classmethod
    def wrap(cls, batch: Any, split_count: int = 1) -> ElasticBatch:
        """Take any supported batch structure apart; an ``ElasticBatch`` is returned as it is.

        Raises:
            TypeError: a part of the batch cannot be split (names the type and ``register_batch_type``).
            ValueError: fields disagree on the batch size (names the fields and their sizes).
        """
        if isinstance(batch, ElasticBatch):
            return batch
        fields, spec, rows = flatten(batch)
        wrapped = cls.__new__(cls)
        wrapped._set(fields, spec, rows, split_count, None, batch)
        return wrapped

    @classmethod
    def deferred(cls, batch: Any, split_count: int = 1) -> ElasticBatch:
        """Wrap a batch without taking it apart yet: that happens on first use, raising what :meth:`wrap` raises.

        What the loader yields (from its workers too: the batch crosses the queue as the plain
        loader's would): a batch that is never split (or moved) is never taken apart.

        Example:
            >>> import torch
            >>> from elastic_batches import ElasticBatch
            >>> x = torch.zeros(4, 2)
            >>> batch = ElasticBatch.deferred({"x": x})
            >>> len(batch), batch.unwrap()["x"] is x
            (4, True)
        """
        if isinstance(batch, ElasticBatch):
            return batch
        deferred = cls.__new__(cls)
        deferred._set(None, None, None, split_count, None, batch)
        return deferred

    @property
    def split_count(self) -> int:
        """The number of microbatches this batch was tagged with (at least 1)."""
        count = self._split_count
        if count is None:
            assert self._settled is not None
            count = self._settled.count_of(self)
            self._split_count = count
        return count

    @split_count.setter
    def split_count(self, value: int) -> None:
        if not is_int(value) or value < 1:
            raise ValueError(f"ElasticBatch.split_count must be an int >= 1, got {value!r}")
        self._split_count = value

    def tag(self, settled: SettledSplit) -> None:
        """Tag the batch with what a controller has settled on (``controller.settled``).

        :attr:`split_count` becomes the count ``settled`` gives this batch, worked out when it is
        first read: the count of the moment of tagging, at the cost of one assignment (the loader
        tags every batch it yields).

        Example:
            >>> import torch
            >>> import elastic_batches as eb
            >>> controller = eb.SplitController(split_count=3)
            >>> batch = eb.ElasticBatch.wrap(torch.zeros(10, 2))
            >>> batch.tag(controller.settled)
            >>> controller.record_oom(size=4, load=10)  # learned later: does not change the tag
            >>> batch.split_count, controller.count_for(10)
            (3, 5)
        """
        self._settled = settled
        self._split_count = None

    @property
    def tagged_by(self) -> object | None:
        """The token of the :class:`SplitController` whose settled state tagged the batch (:meth:`tag`), or ``None``.

        A controller's token is ``controller.settled.source``: the batch keeps no reference to the controller.
        """
        return None if self._settled is None else self._settled.source

    @property
    def fields(self) -> Fields:
        """The batch's flat fields: key -> tensor, TensorDict or per-sample list, all with the rows first.

        Raises:
            TypeError, ValueError: as :meth:`wrap`, for a batch taken apart only now.
        """
        fields = self._fields
        if fields is None:
            fields, self._spec, self._rows = flatten(self._source)
            self._fields = fields
        return fields

    @property
    def spec(self) -> BatchSpec:
        """How the user's structure is rebuilt around the fields."""
        if self._spec is None:
            self.fields  # noqa: B018 - takes the batch apart
        assert self._spec is not None
        return self._spec

    @property
    def data(self) -> TensorDictBase:
        """The batch's fields as a ``TensorDict`` with ``batch_size=[B]``, built on first read.

        It shares the fields' tensors (in-place changes show in the microbatches); keys set on
        it do not.
        """
        if self._data is None:
            self._data = as_tensordict(self.fields, len(self))
        return self._data

    def __len__(self) -> int:
        rows = self._rows
        if rows is None:
            rows = leading_rows(self._source)
            if rows is None:
                self.fields  # noqa: B018 - takes the batch apart, which counts its rows
                rows = self._rows
                assert rows is not None
            self._rows = rows
        return rows

    def __repr__(self) -> str:
        return f"ElasticBatch(rows={len(self)}, split_count={self.split_count}, fields={sorted(self.fields)})"

    def __getstate__(self) -> dict[str, Any]:
        state = {"split_count": self.split_count, "padding": self.padding}
        if self._fields is None:  # not taken apart yet: it travels as the user's object (from a worker)
            return {**state, "source": self._source}
        return {**state, "fields": self._fields, "spec": self._spec, "rows": len(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "source" in state:
            self._set(None, None, None, state["split_count"], state["padding"], state["source"])
        else:
            self._set(state["fields"], state["spec"], state["rows"], state["split_count"], state["padding"], _NO_SOURCE)

    def unwrap(self) -> Any:
        """The whole batch in the user's own structure."""
        if self._source is not _NO_SOURCE:
            return self._source
        return rebuild(self.fields, self.spec)

    def _with_fields(self, fields: Fields, spec: BatchSpec) -> ElasticBatch:
        batch = ElasticBatch.__new__(ElasticBatch)
        batch._set(fields, spec, len(self), self.split_count, self.padding, _NO_SOURCE)
        batch._settled = self._settled  # who tagged it (the count itself is worked out already)
        return batch

    def to(self, device: torch.device | str | int, *, non_blocking: bool = False) -> ElasticBatch:
        """A copy of the batch on ``device``, moved as :meth:`Microbatch.to` moves; the tag is kept."""

        def move(t: Any) -> Any:
            return t.to(device, non_blocking=non_blocking)

        return self._with_fields(_moved(self.fields, move, device), map_constants(self.spec, move))

    def pin_memory(self) -> ElasticBatch:
        """A copy in page-locked memory (called by the DataLoader's pin-memory thread)."""
        return self._with_fields(_moved(self.fields, lambda t: t.pin_memory()), self.spec)

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

    def microbatches(
        self, split_count: int | None = None, *, balance: str = "rows", sizes: Sequence[int] | None = None
    ) -> Iterator[Microbatch]:
        """Cut the batch into microbatches of consecutive rows.

        A padded batch's microbatches hold their padded fields cut to their own longest sample
        (rounded up by the padding's ``ShapeBuckets``, if any).

        Args:
            split_count: Number of pieces; defaults to the batch's tag. More pieces than rows
                is not possible: it is capped at the number of rows.
            balance: ``"rows"`` (default): pieces differ by at most one row. ``"tokens"``: the
                largest piece's padded positions are as few as the count allows and the pieces
                carry similar token counts (see :class:`BatchLoad`); needs a padded batch.
            sizes: The rows of each piece, in order (a plan's cut, ``BatchLoad.sizes``); they
                must add up to the batch's rows. Replaces ``split_count`` and ``balance``.

        Yields:
            :class:`Microbatch` objects whose weights (rows / batch rows) sum to 1.

        Raises:
            ValueError: the batch is empty, or ``split_count`` is not a positive int.
        """
        rows = len(self)
        if rows == 0:
            raise ValueError("cannot split an empty batch (0 rows): check the DataLoader's sampler and dataset")
        if sizes is not None:
            if sum(sizes) != rows or min(sizes, default=0) < 1:
                raise ValueError(f"ElasticBatch.microbatches: sizes {list(sizes)} do not cut {rows} rows into pieces")
            count = len(sizes)
        else:
            count = self.split_count if split_count is None else split_count
            if not is_int(count) or count < 1:
                raise ValueError(f"split_count must be an int >= 1, got {count!r}")
            count = min(count, rows)
            sizes = split_sizes(rows, count) if balance == "rows" else self.load(balance).sizes(count)
        fields, spec = self.fields, self.spec
        if count == 1 and self.padding is None:  # the whole batch: nothing to slice
            yield Microbatch(fields, 1.0, 0, 1, spec, self._source)
            return
        if self.padding is None:
            for index, (piece, size) in enumerate(zip(split_fields(fields, list(sizes)), sizes, strict=True)):
                yield Microbatch(piece, size / rows, index, count, spec)
            return
        # One padded piece at a time: each is a copy, so only the microbatch running holds one.
        for index, (size, stop) in enumerate(zip(sizes, itertools.accumulate(sizes), strict=True)):
            yield Microbatch(self.padding.piece(fields, stop - size, stop), size / rows, index, count, spec)

    def microbatch(self, start: int, stop: int, *, index: int = 0, count: int = 1) -> Microbatch:
        """Rows ``start:stop`` as one microbatch, weighted by its rows, as :meth:`microbatches` cuts each piece.

        ``ElasticStep`` cuts an attempt that measures memory with it, one piece at a time, each at
        the size predicted from the pieces before it (the pieces of one batch may then differ in
        size).

        Args:
            start: The first row.
            stop: One past the last row.
            index: The microbatch's position in its split.
            count: The number of microbatches in its split.

        Raises:
            ValueError: ``start:stop`` is empty or not within the batch's rows.

        Example:
            >>> import torch
            >>> from elastic_batches import ElasticBatch
            >>> mb = ElasticBatch.wrap({"x": torch.arange(10)}).microbatch(0, 2, count=4)
            >>> mb.unwrap()["x"].tolist(), mb.weight
            ([0, 1], 0.2)
        """
        rows = len(self)
        if not 0 <= start < stop <= rows:
            raise ValueError(f"ElasticBatch.microbatch: rows {start}:{stop} are not a non-empty part of {rows} rows")
        fields = self.fields
        if self.padding is not None:
            piece = self.padding.piece(fields, start, stop)
        elif start == 0 and stop == rows:
            return Microbatch(fields, 1.0, index, count, self.spec, self._source)
        else:
            piece = slice_fields(fields, start, stop)
        return Microbatch(piece, (stop - start) / rows, index, count, self.spec)

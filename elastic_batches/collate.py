"""The elastic collate: runs in DataLoader workers and turns each batch into an ``ElasticBatch``.

It calls the user's ``collate_fn`` (or torch's default collate, extended with the functions
given to :func:`register_collate`) and wraps the result in a deferred :class:`ElasticBatch`:
it crosses from a worker to the main process as the plain loader's batch would, and is taken
apart with the batch-type registry when the step first cuts it. With ``pad_values`` it first
pads the variable-length fields (see :mod:`elastic_batches.padding`). It
pickles both registries along, so that registrations made in ``__main__`` apply in workers
started with ``spawn`` (registrations whose functions cannot be pickled, such as lambdas, stay
behind: use module-level functions with ``spawn``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from torch.utils.data._utils.collate import collate, default_collate_fn_map, default_convert

from elastic_batches.batch import ElasticBatch
from elastic_batches.buckets import ShapeBuckets
from elastic_batches.padding import PadValue, check_pad_values, collate_padded
from elastic_batches.structures import install_batch_types, registered_batch_types
from elastic_batches.trim import TrimPadding

__all__ = ["ElasticCollate", "register_collate"]

_COLLATE_FNS: dict[type, Callable[..., Any]] = {}

_V = TypeVar("_V")


def _picklable(registry: Mapping[type, _V]) -> dict[type, _V]:
    """The entries that can travel to a ``spawn`` worker (lambdas and local functions cannot)."""
    kept = {}
    for cls, value in registry.items():
        try:
            pickle.dumps((cls, value))
        except Exception:  # noqa: BLE001 - any pickling failure means the entry stays behind
            continue
        kept[cls] = value
    return kept


def register_collate(cls: type, collate_fn: Callable[..., Any]) -> None:
    """Collate samples of type ``cls`` with ``collate_fn`` in the loader's default collate.

    Follows torch's ``collate_fn_map`` convention: ``collate_fn(samples, *, collate_fn_map=None)``
    receives the list of one field's values across the samples and returns the batched value.
    Applies to loaders that use the default collate (no ``collate_fn`` of their own), in the
    main process and in workers, ``spawn`` included. Combine it with
    :func:`register_batch_type` when the batched value is of a type the library cannot split.

    Args:
        cls: The sample field type (matched with ``isinstance``).
        collate_fn: The function that batches a list of such values.

    Raises:
        TypeError: ``cls`` is not a class, or ``collate_fn`` is not callable.

    Example:
        >>> import torch
        >>> import elastic_batches as eb
        >>> class Point:
        ...     def __init__(self, xy):
        ...         self.xy = xy
        >>> eb.register_collate(Point, lambda points, *, collate_fn_map=None: torch.stack([p.xy for p in points]))
        >>> eb.ElasticCollate()([Point(torch.zeros(2)), Point(torch.ones(2))]).data["batch"].shape
        torch.Size([2, 2])
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_collate expects a class, got {cls!r}")
    if not callable(collate_fn):
        raise TypeError(f"register_collate({cls.__qualname__}): collate_fn must be callable, got {collate_fn!r}")
    _COLLATE_FNS[cls] = collate_fn


def _install_collate_fns(registry: Mapping[type, Callable[..., Any]]) -> None:
    for cls, fn in registry.items():
        _COLLATE_FNS.setdefault(cls, fn)


class ElasticCollate:
    """A picklable collate function that returns :class:`ElasticBatch` objects.

    Args:
        collate_fn: The user's collate function; ``None``: torch's default collate (or
            ``default_convert`` without automatic batching), extended by :func:`register_collate`.
            A collate function that pads itself (Hugging Face's collators) is kept by wrapping
            it in :class:`TrimPadding`, instead of giving ``pad_values``.
        auto_collation: ``False`` when the DataLoader's dataset yields whole batches
            (``batch_size=None``).
        pad_values: Names the per-sample fields of varying length and the value to pad each
            with: they are padded to the batch's longest sample, and each microbatch is later cut
            to its own (see :func:`elastic_batches.padding.collate_padded`). Samples must then
            be mappings; the other fields go through ``collate_fn``. ``None``: no padding.
        sort_by_length: With ``pad_values``, sort each batch's samples longest first, so that
            microbatches hold samples of similar length (default ``True``).
        shape_buckets: With ``pad_values``, round microbatch shapes up for ``torch.compile``.

    Raises:
        TypeError: ``collate_fn`` is not callable, or ``pad_values`` is not a mapping of numbers.
        ValueError: ``pad_values`` without automatic batching or with a :class:`TrimPadding`
            ``collate_fn``, or ``shape_buckets`` without ``pad_values``.

    Example:
        >>> import torch
        >>> from elastic_batches import ElasticCollate
        >>> batch = ElasticCollate()([{"x": torch.zeros(3), "y": 0}, {"x": torch.ones(3), "y": 1}])
        >>> batch.unwrap()["y"]
        tensor([0, 1])
        >>> padded = ElasticCollate(pad_values={"ids": 0})([{"ids": [5]}, {"ids": [6, 7]}])
        >>> padded.unwrap()["ids"]
        tensor([[6, 7],
                [5, 0]])
    """

    def __init__(
        self,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        *,
        auto_collation: bool = True,
        pad_values: Mapping[Any, PadValue] | None = None,
        sort_by_length: bool = True,
        shape_buckets: ShapeBuckets | None = None,
    ) -> None:
        if isinstance(collate_fn, ElasticCollate):
            collate_fn = collate_fn.collate_fn
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"ElasticCollate: collate_fn must be callable or None, got {collate_fn!r}")
        self.collate_fn: Callable[[list[Any]], Any] | None = collate_fn
        self.auto_collation = auto_collation
        self.pad_values = check_pad_values(pad_values)
        self.sort_by_length = bool(sort_by_length)
        if shape_buckets is not None and not isinstance(shape_buckets, ShapeBuckets):
            raise TypeError(
                f"ElasticCollate: shape_buckets must be an elastic_batches.ShapeBuckets, got {shape_buckets!r}"
            )
        self.shape_buckets = shape_buckets
        if self.pad_values is not None and isinstance(collate_fn, TrimPadding):
            raise ValueError(
                "pad_values pads the samples itself, TrimPadding keeps the collate function that pads: give one of "
                "them (TrimPadding(collate_fn, pad_values=...) takes pad values of its own)"
            )
        if self.pad_values is not None and not auto_collation:
            raise ValueError(
                "pad_values needs automatic batching: give the loader a batch_size (it has batch_size=None, "
                "so the dataset yields whole batches; pad them in the dataset instead)"
            )
        if shape_buckets is not None and self.pad_values is None:
            raise ValueError("shape_buckets rounds padded shapes up: it needs pad_values={field: pad value}")

    def _collate(self, samples: Any) -> Any:
        if self.collate_fn is not None:
            return self.collate_fn(samples)
        if self.auto_collation:
            collate_fn_map: dict[Any, Callable[..., Any]] = default_collate_fn_map
            if _COLLATE_FNS:
                collate_fn_map = {**default_collate_fn_map, **_COLLATE_FNS}
            return collate(samples, collate_fn_map=collate_fn_map)
        return default_convert(samples)

    def __call__(self, samples: Any) -> ElasticBatch:
        if self.pad_values is not None:
            return collate_padded(
                samples,
                self.pad_values,
                collate_rest=self._collate,
                sort_by_length=self.sort_by_length,
                buckets=self.shape_buckets,
            )
        return ElasticBatch.deferred(self._collate(samples))  # taken apart on first use, if ever

    def __getstate__(self) -> dict[str, Any]:
        return {
            "collate_fn": self.collate_fn,
            "auto_collation": self.auto_collation,
            "pad_values": self.pad_values,
            "sort_by_length": self.sort_by_length,
            "shape_buckets": self.shape_buckets,
            "batch_types": _picklable(registered_batch_types()),
            "collate_fns": _picklable(_COLLATE_FNS),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        install_batch_types(state["batch_types"])
        _install_collate_fns(state["collate_fns"])
        self.collate_fn = state["collate_fn"]
        self.auto_collation = state["auto_collation"]
        self.pad_values = state["pad_values"]
        self.sort_by_length = state["sort_by_length"]
        self.shape_buckets = state["shape_buckets"]

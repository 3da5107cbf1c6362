"""The two registries a user fills: batch types the library splits, and sample types the default collate batches.

``register_batch_type`` teaches :func:`elastic_batches.structures.flatten` to take a batch class
apart; ``register_collate`` extends torch's default collate with a function for a sample type.
Both registrations must reach DataLoader workers, also those started with ``spawn``: the
loader's collate object carries a :func:`snapshot` of both and :func:`install` merges it in the
worker (entries whose functions cannot be pickled, such as lambdas, stay behind: use
module-level functions with ``spawn``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

from torch.utils.data._utils.collate import default_collate_fn_map

__all__ = ["collate_fn_map", "install", "register_batch_type", "register_collate", "registration_for", "snapshot"]

_V = TypeVar("_V")


class _Registration(NamedTuple):
    to_tensordict: Callable[[Any], Mapping[str, Any]]
    from_tensordict: Callable[[dict[str, Any]], Any]


_BATCH_TYPES: dict[type, _Registration] = {}


def register_batch_type(
    cls: type,
    *,
    to_tensordict: Callable[[Any], Mapping[str, Any]],
    from_tensordict: Callable[[dict[str, Any]], Any],
) -> None:
    """Teach elastic_batches to split a batch class it cannot take apart itself.

    Registrations made in ``__main__`` reach DataLoader workers, also with the ``spawn`` start
    method: the loader's collate object carries them.

    Args:
        cls: The batch class. Subclasses use the registration of their nearest registered base.
        to_tensordict: ``obj -> mapping`` of fields: tensors with the batch as first dimension,
            per-sample lists, nested structures or values to broadcast.
        from_tensordict: ``fields -> obj``; receives a plain ``dict`` holding the same keys, each
            cut to one microbatch's rows, and rebuilds the object.

    Raises:
        TypeError: ``cls`` is not a class, or a converter is not callable.

    Example:
        >>> import torch
        >>> import elastic_batches as eb
        >>> class Pair:
        ...     def __init__(self, x, y):
        ...         self.x, self.y = x, y
        >>> eb.register_batch_type(
        ...     Pair,
        ...     to_tensordict=lambda p: {"x": p.x, "y": p.y},
        ...     from_tensordict=lambda f: Pair(f["x"], f["y"]),
        ... )
        >>> batch = eb.ElasticBatch.wrap(Pair(torch.zeros(4, 2), torch.ones(4)))
        >>> [mb.unwrap().x.shape[0] for mb in batch.microbatches(2)]
        [2, 2]
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_batch_type expects a class, got {cls!r}")
    for name, fn in (("to_tensordict", to_tensordict), ("from_tensordict", from_tensordict)):
        if not callable(fn):
            raise TypeError(f"register_batch_type({cls.__qualname__}): {name} must be callable, got {fn!r}")
    _BATCH_TYPES[cls] = _Registration(to_tensordict, from_tensordict)


def registration_for(cls: type) -> _Registration | None:
    """The registration of ``cls`` or of its nearest registered base, or ``None``."""
    if not _BATCH_TYPES:
        return None  # the common case, on every field of every batch
    for base in cls.__mro__:
        registration = _BATCH_TYPES.get(base)
        if registration is not None:
            return registration
    return None


_COLLATE_FNS: dict[type, Callable[..., Any]] = {}


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


def collate_fn_map() -> dict[Any, Callable[..., Any]]:
    """torch's default ``collate_fn_map``, extended with the registered collate functions."""
    return {**default_collate_fn_map, **_COLLATE_FNS} if _COLLATE_FNS else default_collate_fn_map


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


def snapshot() -> dict[str, dict[type, Any]]:
    """Both registries' entries that can travel to a ``spawn`` worker."""
    return {"batch_types": _picklable(_BATCH_TYPES), "collate_fns": _picklable(_COLLATE_FNS)}


def install(registries: Mapping[str, Mapping[type, Any]]) -> None:
    """Merge a :func:`snapshot` into this process's registries (in a DataLoader worker); what is there stays."""
    for cls, registration in registries["batch_types"].items():
        _BATCH_TYPES.setdefault(cls, registration)
    for cls, fn in registries["collate_fns"].items():
        _COLLATE_FNS.setdefault(cls, fn)

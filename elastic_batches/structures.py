"""The user's batch structure <-> flat, row-splittable fields, and back.

A batch is taken apart into *fields*: every tensor with a batch dimension, every per-sample list
of Python objects, every nested TensorDict or tensorclass. They go into one flat ``dict`` (key ->
field) whose values all have the batch as first dimension, so that any row slice of every value
is a row slice of the batch; :func:`to_tensordict` wraps them in one ``TensorDict`` with
``batch_size=[B]`` (per-sample lists as ``NonTensorStack``). What is left — the containers and the
values without a batch dimension — is kept in a small picklable *spec* that rebuilds the user's
structure around any row slice of the fields.

Rules, in order:

- a registered type (``register_batch_type``) is taken apart by its ``to_tensordict``;
- a ``TensorDict`` or a tensorclass is one field (it must have the batch as first dimension);
- a tensor with at least one dimension is a field; a 0-d tensor is broadcast to every microbatch;
- a mapping, a tuple or namedtuple, a dataclass instance is a container;
- a list is a container when one of its items holds a tensor (at any depth), else it holds one
  Python object per sample (strings, dicts or lists of plain values...) and is split with the rows;
- ``str``, ``bytes``, numbers, ``None``, ``torch.dtype``/``torch.device`` and tuples of those
  are broadcast to every microbatch;
- anything else raises ``TypeError`` naming the type and ``register_batch_type``.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import itertools
import numbers
import sys
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase, is_tensorclass

from elastic_batches.registry import register_batch_type, registration_for

__all__ = [
    "BatchSpec",
    "Fields",
    "as_tensordict",
    "constant_tensors",
    "flatten",
    "leading_rows",
    "rebuild",
    "register_batch_type",
    "slice_fields",
    "split_fields",
    "to_tensordict",
]

Fields = dict[str, Any]
"""Flat fields of a batch: key -> tensor, TensorDict, tensorclass or per-sample list, all ``B`` rows long."""


# ----------------------------------------------------------------------------------------------
# The spec: a tree of small picklable nodes. Leaves name a field of the TensorDict or hold a value.


@dataclasses.dataclass(frozen=True)
class _Field:
    key: str


@dataclasses.dataclass(frozen=True)
class _Constant:
    value: Any


@dataclasses.dataclass(frozen=True)
class _Objects:
    key: str


@dataclasses.dataclass(frozen=True)
class _Sequence:
    rebuild: Callable[[list[Any]], Any]
    children: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class _Map:
    template: Any  # an empty copy of the user's mapping, or None for a plain dict
    keys: tuple[Any, ...]
    children: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class _Dataclass:
    template: Any  # a shallow copy whose fields were set to None
    names: tuple[str, ...]
    children: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class _Registered:
    cls: type
    inner: _Map


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """How to rebuild a user's batch structure around the fields of a TensorDict.

    Produced by :func:`flatten` and :func:`to_tensordict`, consumed by :func:`rebuild`; picklable.
    """

    root: Any
    has_constant_tensors: bool = dataclasses.field(default=True, compare=False)  # False: no 0-d tensor broadcast


_ATOMS = (str, bytes, numbers.Number, type(None), torch.dtype, torch.device, enum.Enum)


def _is_atom(value: Any) -> bool:
    if isinstance(value, _ATOMS):
        return True
    if type(value) is tuple:
        return all(_is_atom(item) for item in value)
    return False


def _is_container(value: Any) -> bool:
    return (
        isinstance(value, (torch.Tensor, Mapping, tuple, list, TensorDictBase))
        or is_tensorclass(value)
        or (dataclasses.is_dataclass(value) and not isinstance(value, type))
        or registration_for(type(value)) is not None
    )


def _holds_tensor(value: Any) -> bool:
    """Whether ``value`` holds a tensor, TensorDict, tensorclass or registered batch at any depth."""
    if isinstance(value, (torch.Tensor, TensorDictBase)) or is_tensorclass(value):
        return True
    if registration_for(type(value)) is not None:
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_holds_tensor(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def _path_key(path: tuple[str, ...]) -> str:
    return ".".join(path) if path else "batch"


def _rebuild_tuple(items: list[Any]) -> tuple[Any, ...]:
    return tuple(items)


def _rebuild_list(items: list[Any]) -> list[Any]:
    return list(items)


class _NamedTupleRebuild:
    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __call__(self, items: list[Any]) -> Any:
        return self.cls(*items)


class _Flattener:
    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.sizes: dict[str, int] = {}
        self.constant_tensors = False  # a 0-d tensor was met: it is broadcast

    def add(self, path: tuple[str, ...], value: Any, size: int) -> str:
        key = base = _path_key(path)
        suffix = 1
        while key in self.fields:  # {"a.b": x, "a": {"b": y}} or {1: x, "1": y}: keep both fields
            key, suffix = f"{base}#{suffix}", suffix + 1
        self.fields[key] = value
        self.sizes[key] = size
        return key

    def visit(self, value: Any, path: tuple[str, ...]) -> Any:
        kind = type(value)
        if kind is torch.Tensor:  # fast paths for what default collate yields (never a registered type)
            return self._tensor(value, path)
        if kind is dict:
            return self._visit_mapping(value, path, template=None)
        registration = registration_for(kind)
        if registration is not None:
            fields = registration.to_tensordict(value)
            if not isinstance(fields, Mapping):
                raise TypeError(
                    f"to_tensordict registered for {type(value).__qualname__} returned "
                    f"{type(fields).__qualname__}; it must return a mapping of fields (dict or TensorDict)"
                )
            inner = self._visit_mapping(dict(fields.items()), path, template=None)
            return _Registered(type(value), inner)
        if isinstance(value, TensorDictBase) or is_tensorclass(value):
            if not value.batch_dims:
                raise ValueError(
                    f"field '{_path_key(path)}' is a {type(value).__qualname__} without batch dimensions; "
                    "give it batch_size=[B] so it can be split by rows"
                )
            return _Field(self.add(path, value, int(value.batch_size[0])))
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, Mapping):
            return self._visit_mapping(value, path, template=_empty_copy(value))
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            children = tuple(self.visit(v, (*path, name)) for name, v in zip(value._fields, value, strict=True))
            return _Sequence(_NamedTupleRebuild(type(value)), children)
        if _is_atom(value):
            return _Constant(value)
        if isinstance(value, (list, tuple)):
            # a list of plain per-sample values (dicts of metadata, token lists) is split with the rows
            holds = _holds_tensor if isinstance(value, list) else _is_container
            if any(holds(item) for item in value):
                rebuild = _rebuild_list if isinstance(value, list) else _rebuild_tuple
                children = tuple(self.visit(v, (*path, str(i))) for i, v in enumerate(value))
                return _Sequence(rebuild, children)
            if isinstance(value, tuple):
                raise TypeError(
                    f"field '{_path_key(path)}' is a tuple of per-sample objects; use a list for values "
                    "with one item per sample, or register the batch type with "
                    "elastic_batches.register_batch_type"
                )
            return _Objects(self.add(path, list(value), len(value)))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            names = tuple(f.name for f in dataclasses.fields(value))
            children = tuple(self.visit(getattr(value, name), (*path, name)) for name in names)
            template = copy.copy(value)
            for name in names:
                object.__setattr__(template, name, None)
            return _Dataclass(template, names, children)
        raise TypeError(_unsplittable(type(value), path))

    def _tensor(self, value: torch.Tensor, path: tuple[str, ...]) -> _Field | _Constant:
        if value.dim() == 0:
            self.constant_tensors = True
            return _Constant(value)
        return _Field(self.add(path, value, value.shape[0]))

    def _visit_mapping(self, value: Mapping[Any, Any], path: tuple[str, ...], template: Any) -> _Map:
        keys = tuple(value.keys())
        children = tuple(self.visit(value[k], (*path, str(k))) for k in keys)
        return _Map(template, keys, children)


def _importable(cls: type) -> type | None:
    """The class to register for ``cls``: itself, or the first importable base of a class made at run time.

    PyG makes its batch classes at run time (``DataBatch``, from ``Batch``): they cannot be
    imported under their name, so registering them by hand is not possible; their base can be.
    """
    if "<locals>" in cls.__qualname__:
        return cls  # defined in a function: the user has it at hand
    for klass in cls.__mro__:
        found: Any = sys.modules.get(klass.__module__)
        for part in klass.__qualname__.split("."):
            found = getattr(found, part, None)
        if found is klass:
            return None if klass is object else klass
    return None


def _unsplittable(cls: type, path: tuple[str, ...]) -> str:
    """The message for a value of type ``cls`` that no rule can split: the class to register, and how."""
    field = "" if not path else f" (field {_path_key(path)!r})"
    target = _importable(cls) or cls
    made = "" if target is cls else f" (made at run time from {target.__module__}.{target.__qualname__})"
    if target.__module__.split(".")[0] == "torch_geometric":
        how = (
            "register PyG's batches once with elastic_batches.register_pyg_batch() (it splits a Batch by graph), "
            "or register torch_geometric.data.Batch yourself with elastic_batches.register_batch_type"
        )
    else:
        how = (
            f"register {'it' if target is cls else 'that class'} with elastic_batches.register_batch_type("
            f"{target.__qualname__}, to_tensordict=..., from_tensordict=...)"
        )
    return f"cannot split a batch of type {cls.__qualname__}{field}{made}: {how}"


def _empty_copy(mapping: Mapping[Any, Any]) -> Any:
    if type(mapping) is dict:
        return None
    if isinstance(mapping, MutableMapping):
        template = copy.copy(mapping)
        template.clear()
        return template
    raise TypeError(
        f"cannot rebuild a batch of read-only mapping type {type(mapping).__qualname__}: register it with "
        f"elastic_batches.register_batch_type({type(mapping).__qualname__}, to_tensordict=..., from_tensordict=...)"
    )


_TENSORS_SPECS: dict[tuple[type, tuple[str, ...]], BatchSpec] = {}  # by container type and field keys


def _flatten_tensors(batch: Any) -> tuple[Fields, BatchSpec, int] | None:
    """What default collate yields most: a dict (``str`` keys) or a tuple or list of batched tensors.

    The fields and spec :func:`flatten`'s general walk would build, without the walk (specs are
    kept per container type and keys); ``None`` for anything else, or fields that disagree.
    """
    kind = type(batch)
    if kind is dict:
        keys = tuple(batch)
        if not all(type(key) is str for key in keys):
            return None
        values = tuple(batch.values())
    elif (kind is tuple or kind is list) and batch:
        values = tuple(batch)
        keys = tuple(str(index) for index in range(len(values)))
    else:
        return None
    if not all(type(value) is torch.Tensor and value.dim() for value in values) or registration_for(kind):
        return None
    rows = values[0].shape[0]
    if any(value.shape[0] != rows for value in values):
        return None  # the general walk names the fields that disagree
    spec = _TENSORS_SPECS.get((kind, keys))
    if spec is None:
        children = tuple(_Field(key) for key in keys)
        if kind is dict:
            spec = BatchSpec(_Map(None, keys, children), has_constant_tensors=False)
        else:
            spec = BatchSpec(_Sequence(_rebuild_tuple if kind is tuple else _rebuild_list, children), False)
        if len(_TENSORS_SPECS) >= 256:
            _TENSORS_SPECS.clear()
        _TENSORS_SPECS[(kind, keys)] = spec
    return dict(zip(keys, values, strict=True)), spec, int(rows)


def flatten(batch: Any) -> tuple[Fields, BatchSpec, int]:
    """Take a batch apart into flat fields, the spec that rebuilds it, and its rows.

    Raises:
        TypeError: a value of a type that cannot be split; the message names the type and
            ``register_batch_type``.
        ValueError: the batch has no field with a batch dimension, or fields disagree on the
            batch size (the message names each field and its size).

    Example:
        >>> import torch
        >>> from elastic_batches.structures import flatten, rebuild, slice_fields
        >>> fields, spec, rows = flatten({"x": torch.zeros(3, 2), "text": ["a", "b", "c"], "lr": 0.1})
        >>> sorted(fields), rows
        (['text', 'x'], 3)
        >>> rebuild(slice_fields(fields, 1, 3), spec)["text"]
        ['b', 'c']
    """
    flat = _flatten_tensors(batch)
    if flat is not None:
        return flat
    flattener = _Flattener()
    root = flattener.visit(batch, ())
    sizes = flattener.sizes
    if not sizes:
        raise ValueError(
            f"cannot split a batch of type {type(batch).__qualname__}: it holds no tensor with a batch "
            "dimension and no per-sample list"
        )
    distinct = set(sizes.values())
    if len(distinct) > 1:
        listed = ", ".join(f"'{key}' ({size})" for key, size in sizes.items())
        raise ValueError(f"batch fields disagree on the batch size (leading dimension): {listed}")
    return flattener.fields, BatchSpec(root, flattener.constant_tensors), distinct.pop()


def leading_rows(batch: Any) -> int | None:
    """The batch's rows read from its first tensor, for what default collate yields; else ``None``.

    A cheap look at a tensor, or at the first value of a ``dict``, ``tuple`` or ``list`` when that
    is a tensor with a batch dimension: what :func:`flatten` finds for such a batch when its
    fields agree (it checks that they do).

    Example:
        >>> import torch
        >>> from elastic_batches.structures import leading_rows
        >>> leading_rows({"x": torch.zeros(5, 2), "y": torch.zeros(5)}), leading_rows(["a", "b"])
        (5, None)
    """
    kind = type(batch)
    if kind is dict:
        first = next(iter(batch.values()), None)
    elif (kind is tuple or kind is list) and batch:
        first = batch[0]
    else:
        first = batch
    if type(first) is not torch.Tensor or not first.dim() or registration_for(kind) is not None:
        return None
    return int(first.shape[0])


def slice_fields(fields: Fields, start: int, stop: int) -> Fields:
    """Rows ``start:stop`` of every field."""
    return {key: value[start:stop] for key, value in fields.items()}


def split_fields(fields: Fields, sizes: list[int]) -> list[Fields]:
    """The fields cut into consecutive pieces of ``sizes`` rows (a tensor in one ``split_with_sizes`` call).

    Example:
        >>> import torch
        >>> from elastic_batches.structures import split_fields
        >>> pieces = split_fields({"x": torch.arange(5), "names": list("abcde")}, [3, 2])
        >>> [(p["x"].tolist(), p["names"]) for p in pieces]
        [([0, 1, 2], ['a', 'b', 'c']), ([3, 4], ['d', 'e'])]
    """
    columns: list[tuple[str, Sequence[Any]]] = []
    bounds: list[tuple[int, int]] | None = None
    for key, value in fields.items():
        if type(value) is torch.Tensor:
            columns.append((key, value.split_with_sizes(sizes)))  # not .split: its Python wrapper costs as much
            continue
        if bounds is None:  # per-sample lists and nested TensorDicts are sliced
            stops = list(itertools.accumulate(sizes))
            bounds = list(zip([0, *stops[:-1]], stops, strict=True))
        columns.append((key, [value[a:b] for a, b in bounds]))
    return [{key: pieces[i] for key, pieces in columns} for i in range(len(sizes))]


def as_tensordict(fields: Fields, rows: int) -> TensorDict:
    """The fields as one ``TensorDict`` with ``batch_size=[rows]`` (per-sample lists as ``NonTensorStack``)."""
    return TensorDict(
        {
            key: (NonTensorStack.from_list(value) if value else NonTensorStack()) if type(value) is list else value
            for key, value in fields.items()
        },
        batch_size=[rows],
    )


def to_tensordict(batch: Any) -> tuple[TensorDict, BatchSpec]:
    """Take a batch apart into a row-splittable TensorDict and the spec that rebuilds it.

    Args:
        batch: What a DataLoader yields: a tensor, or any nesting of the supported structures.

    Returns:
        ``(fields, spec)``: a ``TensorDict`` with ``batch_size=[B]`` and a :class:`BatchSpec`.

    Raises:
        TypeError, ValueError: as :func:`flatten`.

    Example:
        >>> import torch
        >>> from elastic_batches.structures import rebuild, to_tensordict
        >>> fields, spec = to_tensordict({"x": torch.zeros(3, 2), "text": ["a", "b", "c"], "lr": 0.1})
        >>> fields.batch_size
        torch.Size([3])
        >>> rebuild(fields[1:], spec)["text"]
        ['b', 'c']
    """
    fields, spec, rows = flatten(batch)
    return as_tensordict(fields, rows), spec


def rebuild(fields: Fields | TensorDictBase, spec: BatchSpec) -> Any:
    """The user's structure around ``fields``: the whole batch or a row slice of it.

    Args:
        fields: The flat fields (from :func:`flatten`) or the ``TensorDict`` (from
            :func:`to_tensordict`), or any row slice of them.
        spec: The spec returned with them.

    Example:
        >>> import torch
        >>> from elastic_batches.structures import rebuild, to_tensordict
        >>> fields, spec = to_tensordict([torch.arange(4), torch.arange(4) * 10])
        >>> rebuild(fields[:2], spec)
        [tensor([0, 1]), tensor([ 0, 10])]
    """
    return _build(spec.root, fields)


def _build(node: Any, fields: Fields | TensorDictBase) -> Any:
    kind = type(node)
    if kind is _Field:
        return fields.get(node.key)
    if kind is _Objects:
        objects: Any = fields.get(node.key)
        return objects if type(objects) is list else objects.tolist()
    if kind is _Constant:
        return node.value
    if kind is _Sequence:
        return node.rebuild([_build(child, fields) for child in node.children])
    if kind is _Map:
        values = {key: _build(child, fields) for key, child in zip(node.keys, node.children, strict=True)}
        if node.template is None:
            return values
        mapping = copy.copy(node.template)
        mapping.update(values)
        return mapping
    if kind is _Dataclass:
        obj = copy.copy(node.template)
        for name, child in zip(node.names, node.children, strict=True):
            object.__setattr__(obj, name, _build(child, fields))
        return obj
    if kind is _Registered:
        registration = registration_for(node.cls)
        if registration is None:
            raise TypeError(
                f"batch type {node.cls.__qualname__} is not registered in this process: call "
                "elastic_batches.register_batch_type at import time of the module that defines it"
            )
        return registration.from_tensordict(_build(node.inner, fields))
    raise TypeError(f"unknown spec node {node!r}")  # pragma: no cover - specs are built above


def map_constants(spec: BatchSpec, fn: Callable[[torch.Tensor], torch.Tensor]) -> BatchSpec:
    """A spec whose broadcast tensors (0-d) went through ``fn``; used to move them to a device."""
    return BatchSpec(_map_constants(spec.root, fn), spec.has_constant_tensors)


def constant_tensors(spec: BatchSpec) -> list[torch.Tensor]:
    """The broadcast (0-d) tensors of a spec, which every microbatch receives whole.

    Example:
        >>> import torch
        >>> from elastic_batches.structures import constant_tensors, flatten
        >>> _, spec, _ = flatten({"x": torch.zeros(3, 2), "scale": torch.tensor(2.0), "name": "a"})
        >>> constant_tensors(spec)
        [tensor(2.)]
    """
    found: list[torch.Tensor] = []
    if spec.has_constant_tensors:
        _collect_constants(spec.root, found)
    return found


def _collect_constants(node: Any, found: list[torch.Tensor]) -> None:
    if isinstance(node, _Constant):
        if isinstance(node.value, torch.Tensor):
            found.append(node.value)
    elif isinstance(node, (_Sequence, _Map, _Dataclass)):
        for child in node.children:
            _collect_constants(child, found)
    elif isinstance(node, _Registered):
        _collect_constants(node.inner, found)


def _map_constants(node: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(node, _Constant) and isinstance(node.value, torch.Tensor):
        return _Constant(fn(node.value))
    if isinstance(node, (_Sequence, _Map, _Dataclass)):
        return dataclasses.replace(node, children=tuple(_map_constants(c, fn) for c in node.children))
    if isinstance(node, _Registered):
        return _Registered(node.cls, _map_constants(node.inner, fn))
    return node

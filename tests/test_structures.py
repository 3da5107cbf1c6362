"""Batch structures <-> TensorDict: every supported structure survives a split, with the right rows.

Each case is a function ``make(rows)`` that builds the batch holding exactly the samples whose
indices are in ``rows``. A microbatch of ``make(range(n))`` cut to rows ``[a, b)`` must then be
``make(range(a, b))``, of the same type, and the whole batch must unwrap to ``make(range(n))``.
"""

from __future__ import annotations

import collections
import dataclasses
import pickle
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import pytest
import torch
from tensordict import TensorDict, TensorDictBase, is_tensorclass, tensorclass

import elastic_batches as eb
from elastic_batches import registry, structures
from elastic_batches.batch import split_sizes
from elastic_batches.structures import rebuild, to_tensordict

# ---------------------------------------------------------------------------------------------
# Structures used as batches (module level: they must pickle for DataLoader workers).


class Pair(NamedTuple):
    inputs: Any
    target: Any


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    label: torch.Tensor
    name: list[str]
    lr: float = 0.1


@dataclasses.dataclass(frozen=True)
class FrozenSample:
    x: torch.Tensor
    meta: Any


@dataclasses.dataclass
class Info:
    """Per-sample metadata without tensors: split with the rows, like strings."""

    index: int
    name: str


@tensorclass
class Tokens:
    ids: torch.Tensor
    mask: torch.Tensor


class AttrDict(dict):
    """A dict subclass with attribute access (many tokenizer and model outputs look like this)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as err:
            raise AttributeError(name) from err


class BatchEncodingLike(collections.UserDict):
    """Shaped like transformers' ``BatchEncoding``: a ``UserDict`` with extra attributes and attribute access."""

    def __init__(self, data: Mapping[str, Any] | None = None, n_sequences: int | None = None) -> None:
        super().__init__(data)
        self._encodings = None
        self._n_sequences = n_sequences

    def __getattr__(self, item: str) -> Any:
        try:
            return self.data[item]
        except KeyError as err:
            raise AttributeError(item) from err

    def __getstate__(self) -> dict[str, Any]:  # as BatchEncoding does: __getattr__ would recurse in pickle
        return {"data": self.data, "encodings": self._encodings, "n_sequences": self._n_sequences}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.data, self._encodings, self._n_sequences = state["data"], state["encodings"], state["n_sequences"]


# ---------------------------------------------------------------------------------------------
# Row builders: the value of sample i is derived from i, so any row range can be rebuilt.


def _x(rows: range, width: int = 3) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.float32)[:, None] * torch.ones(width) + torch.arange(width) / 10


def _ids(rows: range) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.long)


def _names(rows: range) -> list[str]:
    return [f"sample-{i}" for i in rows]


CASES: dict[str, Callable[[range], Any]] = {
    "tensor": _x,
    "int-tensor-3d": lambda r: _ids(r)[:, None, None].expand(-1, 2, 5).clone(),
    "dict": lambda r: {"x": _x(r), "y": _ids(r)},
    "ordered-dict": lambda r: collections.OrderedDict([("y", _ids(r)), ("x", _x(r))]),
    "dict-subclass": lambda r: AttrDict(input_ids=_ids(r), attention_mask=_ids(r) % 2),
    "userdict-batch-encoding": lambda r: BatchEncodingLike({"input_ids": _ids(r), "mask": _x(r)}, n_sequences=1),
    "defaultdict": lambda r: collections.defaultdict(list, {"x": _x(r)}),
    "list": lambda r: [_x(r), _ids(r)],
    "tuple": lambda r: (_x(r), _ids(r)),
    "namedtuple": lambda r: Pair(_x(r), _ids(r)),
    "dataclass": lambda r: Sample(_x(r), _ids(r), _names(r)),
    "frozen-dataclass": lambda r: FrozenSample(_x(r), meta=("fixed", 3)),
    "tensorclass": lambda r: Tokens(ids=_ids(r)[:, None].repeat(1, 4), mask=_ids(r)[:, None] > 2, batch_size=[len(r)]),
    "tensordict": lambda r: TensorDict({"x": _x(r), "nested": {"y": _ids(r)}}, batch_size=[len(r)]),
    "list-of-strings": _names,
    "list-of-ints-per-sample": lambda r: [i * 7 for i in r],
    "strings-in-dict": lambda r: {"x": _x(r), "text": _names(r)},
    "per-sample-dicts": lambda r: {
        "x": _x(r),
        "meta": [{"id": i, "path": f"/d/{i}", "tags": ["t"] * (i % 3)} for i in r],
    },
    "per-sample-token-lists": lambda r: {"ids": _ids(r), "words": [[f"w{j}" for j in range(i % 4)] for i in r]},
    "per-sample-dataclasses-without-tensors": lambda r: {"x": _x(r), "info": [Info(i, f"n{i}") for i in r]},
    "constants-broadcast": lambda r: {
        "x": _x(r),
        "lr": 0.5,
        "step": 3,
        "mode": "train",
        "none": None,
        "scale": torch.tensor(2.0),
        "shape": (3, 4),
        "dtype": torch.float16,
    },
    "nested-mix": lambda r: {
        "inputs": [
            Pair(_x(r), {"text": _names(r), "const": (1, "a")}),
            Tokens(ids=_ids(r), mask=_ids(r) > 1, batch_size=[len(r)]),
        ],
        "labels": (_ids(r), torch.tensor(7)),
        "sample": Sample(_x(r, 2), _ids(r), _names(r), lr=0.01),
        "td": TensorDict({"a": _x(r)}, batch_size=[len(r)]),
    },
}


def assert_same(actual: Any, expected: Any, where: str = "batch") -> None:
    """Equal type and value, recursively; tensors bit-identical with the same dtype."""
    assert type(actual) is type(expected), f"{where}: {type(actual).__qualname__} != {type(expected).__qualname__}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, TensorDictBase) or is_tensorclass(expected):
        assert actual.batch_size == expected.batch_size, where
        actual_td, expected_td = actual.to_tensordict(), expected.to_tensordict()
        assert set(actual_td.keys(True, True)) == set(expected_td.keys(True, True)), where
        for key in expected_td.keys(True, True):
            assert torch.equal(actual_td[key], expected_td[key]), f"{where}.{key}"
    elif isinstance(expected, Mapping):
        assert list(actual.keys()) == list(expected.keys()), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
        if isinstance(expected, collections.UserDict):
            extra = {k: v for k, v in vars(expected).items() if k != "data"}
            assert {k: v for k, v in vars(actual).items() if k != "data"} == extra, where
        if isinstance(expected, collections.defaultdict):
            assert actual.default_factory is expected.default_factory, where
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    elif dataclasses.is_dataclass(expected):
        for field in dataclasses.fields(expected):
            assert_same(getattr(actual, field.name), getattr(expected, field.name), f"{where}.{field.name}")
    else:
        assert actual == expected, where


@pytest.mark.parametrize("rows", [1, 7, 10], ids=["rows-1", "rows-7", "rows-10"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_structure_round_trips_through_microbatches(case: str, rows: int) -> None:
    make = CASES[case]
    original = make(range(rows))
    batch = eb.ElasticBatch.wrap(original)
    assert len(batch) == rows
    assert_same(batch.unwrap(), original)
    for count in sorted({1, 2, 3, rows}):
        sizes = split_sizes(rows, min(count, rows))
        microbatches = list(batch.microbatches(count))
        assert [len(mb) for mb in microbatches] == sizes
        assert sum(mb.weight for mb in microbatches) == pytest.approx(1.0, abs=1e-12)
        start = 0
        for index, (mb, size) in enumerate(zip(microbatches, sizes, strict=True)):
            assert (mb.index, mb.count) == (index, len(sizes))
            assert mb.weight == pytest.approx(size / rows, abs=1e-15)
            assert_same(mb.unwrap(), make(range(start, start + size)), f"microbatch {index} of {count}")
            start += size


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_structure_and_its_split_pickle(case: str) -> None:
    batch = eb.ElasticBatch.wrap(CASES[case](range(6)), split_count=2)
    copy = pickle.loads(pickle.dumps(batch))
    assert copy.split_count == 2
    for mb, expected in zip(copy.microbatches(), (range(0, 3), range(3, 6)), strict=True):
        assert_same(mb.unwrap(), CASES[case](expected))


def test_broadcast_values_are_shared_not_split() -> None:
    scale = torch.tensor(2.0)
    batch = eb.ElasticBatch.wrap({"x": _x(range(6)), "scale": scale, "lr": 0.5, "shape": (3, 4)})
    for mb in batch.microbatches(3):
        out = mb.unwrap()
        assert out["scale"] is scale and out["lr"] == 0.5 and out["shape"] == (3, 4)


def test_fields_that_flatten_to_the_same_name_stay_distinct() -> None:
    original = {"a.b": _x(range(4)), "a": {"b": _ids(range(4))}, 1: _x(range(4)) * 2, "1": _ids(range(4)) * 3}
    batch = eb.ElasticBatch.wrap(original)
    assert_same(batch.unwrap(), original)
    for mb, rows in zip(batch.microbatches(2), (range(0, 2), range(2, 4)), strict=True):
        assert_same(mb.unwrap()["a"]["b"], _ids(rows))
        assert_same(mb.unwrap()["a.b"], _x(rows))


def test_tuple_of_per_sample_objects_asks_for_a_list() -> None:
    class Image:
        pass

    with pytest.raises(TypeError, match=r"tuple of per-sample objects; use a list.*register_batch_type"):
        eb.ElasticBatch.wrap({"x": _x(range(2)), "images": (Image(), Image())})


# ---------------------------------------------------------------------------------------------
# register_batch_type


class Opaque:
    """A batch class the library cannot take apart itself."""

    def __init__(self, x: torch.Tensor, names: list[str], tag: str) -> None:
        self.x, self.names, self.tag = x, names, tag


def _opaque_fields(batch: Opaque) -> dict[str, Any]:
    return {"x": batch.x, "names": batch.names, "tag": batch.tag}


def _opaque_rebuild(fields: dict[str, Any]) -> Opaque:
    return Opaque(fields["x"], fields["names"], fields["tag"])


class OpaqueChild(Opaque):
    pass


@pytest.mark.parametrize("cls", [Opaque, OpaqueChild], ids=["registered-class", "subclass-of-registered"])
def test_registered_batch_type_splits_with_its_converters(cls: type[Opaque]) -> None:
    eb.register_batch_type(Opaque, to_tensordict=_opaque_fields, from_tensordict=_opaque_rebuild)
    batch = eb.ElasticBatch.wrap({"item": cls(_x(range(5)), _names(range(5)), "t")})
    first, second = (mb.unwrap()["item"] for mb in batch.microbatches(2))
    assert type(first) is Opaque  # rebuilt by the base's from_tensordict
    assert torch.equal(first.x, _x(range(3))) and first.names == _names(range(3)) and first.tag == "t"
    assert torch.equal(second.x, _x(range(3, 5))) and second.names == _names(range(3, 5))


def test_registration_can_return_a_tensordict() -> None:
    eb.register_batch_type(
        Opaque,
        to_tensordict=lambda b: TensorDict({"x": b.x}, batch_size=[b.x.shape[0]]),
        from_tensordict=lambda f: Opaque(f["x"], [], "td"),
    )
    batch = eb.ElasticBatch.wrap(Opaque(_x(range(4)), [], "td"))
    assert [mb.unwrap().x.shape[0] for mb in batch.microbatches(4)] == [1, 1, 1, 1]


# ---------------------------------------------------------------------------------------------
# Errors


class Unknown:
    pass


@pytest.mark.parametrize(
    ("batch", "where"),
    [
        (Unknown(), ""),
        ({"x": _x(range(2)), "extra": Unknown()}, r" \(field 'extra'\)"),
        ([_x(range(2)), {"deep": [Unknown(), _x(range(2))]}], r" \(field '1\.deep\.0'\)"),
    ],
    ids=["root", "in-dict", "nested"],
)
def test_unsplittable_type_names_the_type_and_register_batch_type(batch: Any, where: str) -> None:
    with pytest.raises(
        TypeError,
        match=rf"cannot split a batch of type Unknown{where}: register it with "
        r"elastic_batches\.register_batch_type\(Unknown, to_tensordict=\.\.\., from_tensordict=\.\.\.\)",
    ):
        eb.ElasticBatch.wrap(batch)


class Importable:
    pass


def test_a_class_made_at_run_time_names_its_importable_base_to_register() -> None:
    made = type("MadeAtRunTime", (Importable,), {"__module__": "abc"})  # as PyG makes DataBatch from Batch
    with pytest.raises(
        TypeError,
        match=r"type MadeAtRunTime \(made at run time from \S*Importable\): register that class with "
        r"elastic_batches\.register_batch_type\(Importable, to_tensordict=",
    ):
        eb.ElasticBatch.wrap(made())


def test_a_local_class_is_named_itself() -> None:
    class Local(Importable):
        pass

    with pytest.raises(
        TypeError, match=r"<locals>\.Local: register it with elastic_batches\.register_batch_type\(\S*<locals>\.Local,"
    ):
        eb.ElasticBatch.wrap(Local())


def test_read_only_mapping_names_the_type_and_register_batch_type() -> None:
    with pytest.raises(TypeError, match=r"read-only mapping type mappingproxy: register it with .*register_batch_type"):
        eb.ElasticBatch.wrap(types.MappingProxyType({"x": _x(range(2))}))


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"x": torch.zeros(4, 2), "y": torch.zeros(5)}, r"'x' \(4\), 'y' \(5\)"),
        ((torch.zeros(3), ["a", "b"]), r"'0' \(3\), '1' \(2\)"),
        (
            {"ids": torch.zeros(2, 3), "td": TensorDict({"a": torch.zeros(6)}, batch_size=[6])},
            r"'ids' \(2\), 'td' \(6\)",
        ),
    ],
    ids=["tensors", "tensor-and-strings", "tensor-and-tensordict"],
)
def test_leading_dimensions_that_disagree_name_fields_and_sizes(batch: Any, message: str) -> None:
    with pytest.raises(ValueError, match=rf"batch fields disagree on the batch size \(leading dimension\): {message}"):
        eb.ElasticBatch.wrap(batch)


@pytest.mark.parametrize(
    "batch",
    [{"lr": 0.1}, torch.tensor(3.0), ("a", 1)],
    ids=["only-constants", "0-d-tensor", "tuple-of-constants"],
)
def test_batch_without_batch_dimension_is_a_clear_error(batch: Any) -> None:
    with pytest.raises(ValueError, match=r"it holds no tensor with a batch dimension and no per-sample list"):
        eb.ElasticBatch.wrap(batch)


def test_tensordict_without_batch_dimension_is_a_clear_error() -> None:
    with pytest.raises(
        ValueError, match=r"field 'td' is a TensorDict without batch dimensions; give it batch_size=\[B\]"
    ):
        eb.ElasticBatch.wrap({"td": TensorDict({"a": torch.zeros(3)}, batch_size=[])})


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        ("not a class", {"to_tensordict": dict, "from_tensordict": dict}, r"expects a class, got 'not a class'"),
        (
            Opaque,
            {"to_tensordict": 3, "from_tensordict": dict},
            r"register_batch_type\(Opaque\): to_tensordict must be callable",
        ),
        (
            Opaque,
            {"to_tensordict": dict, "from_tensordict": None},
            r"register_batch_type\(Opaque\): from_tensordict must be callable",
        ),
    ],
    ids=["not-a-class", "to-not-callable", "from-not-callable"],
)
def test_register_batch_type_rejects_bad_arguments(cls: Any, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        eb.register_batch_type(cls, **kwargs)


def test_registered_converter_must_return_a_mapping() -> None:
    eb.register_batch_type(Opaque, to_tensordict=lambda b: [b.x], from_tensordict=_opaque_rebuild)
    with pytest.raises(TypeError, match=r"to_tensordict registered for Opaque returned list; it must return a mapping"):
        eb.ElasticBatch.wrap(Opaque(_x(range(2)), [], ""))


def test_unregistered_type_in_another_process_is_named() -> None:
    eb.register_batch_type(Opaque, to_tensordict=_opaque_fields, from_tensordict=_opaque_rebuild)
    fields, spec = to_tensordict(Opaque(_x(range(2)), _names(range(2)), ""))
    del registry._BATCH_TYPES[Opaque]  # as in a process where the registration never ran
    with pytest.raises(
        TypeError, match=r"batch type Opaque is not registered in this process: call .*register_batch_type"
    ):
        rebuild(fields, spec)


@pytest.mark.parametrize(
    "batch",
    [
        {"ids": torch.zeros(4, 3), "label": torch.arange(4)},
        (torch.zeros(4, 3), torch.arange(4)),
        [torch.zeros(4, 3), torch.arange(4)],
        {"x": torch.zeros(4), "lr": torch.tensor(0.5)},  # a 0-d tensor: the general walk
        {1: torch.zeros(4), "1": torch.ones(4)},  # keys that are not all str: the general walk
    ],
    ids=["dict", "tuple", "list", "scalar-tensor", "int-key"],
)
def test_tensor_batches_take_the_short_way_to_the_same_fields_and_spec(batch: Any) -> None:
    short = not isinstance(batch, dict) or all(
        type(v) is torch.Tensor and v.dim() and type(k) is str for k, v in batch.items()
    )
    assert (structures._flatten_tensors(batch) is not None) == short
    fields, spec, rows = structures.flatten(batch)
    walk = structures._Flattener()
    root = walk.visit(batch, ())
    assert list(fields) == list(walk.fields) and all(fields[k] is walk.fields[k] for k in fields)
    assert spec == structures.BatchSpec(root) and rows == 4
    rebuilt = structures.rebuild(structures.slice_fields(fields, 1, 3), spec)
    assert type(rebuilt) is type(batch)


def test_tensor_batches_whose_rows_disagree_are_named_as_always() -> None:
    with pytest.raises(ValueError, match=r"disagree on the batch size .*'ids' \(4\), 'label' \(3\)"):
        structures.flatten({"ids": torch.zeros(4, 3), "label": torch.arange(3)})
    with pytest.raises(ValueError, match=r"disagree on the batch size .*'0' \(4\), '1' \(3\)"):
        structures.flatten((torch.zeros(4, 3), torch.arange(3)))

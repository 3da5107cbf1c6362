"""``ElasticBatch`` and ``Microbatch``: balanced splits, weights, tags, devices, errors."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import elastic_batches as eb
from elastic_batches.batch import split_sizes
from elastic_batches.structures import flatten, to_tensordict


@pytest.mark.parametrize(
    ("rows", "count", "expected"),
    [(10, 3, [4, 3, 3]), (10, 1, [10]), (10, 10, [1] * 10), (256, 6, [43] * 4 + [42] * 2), (7, 4, [2, 2, 2, 1])],
    ids=["10-in-3", "10-in-1", "10-in-10", "256-in-6", "7-in-4"],
)
def test_split_sizes_are_balanced(rows: int, count: int, expected: list[int]) -> None:
    assert split_sizes(rows, count) == expected


def test_split_sizes_never_differ_by_more_than_one_row() -> None:
    for rows in range(1, 60):
        for count in range(1, rows + 1):
            sizes = split_sizes(rows, count)
            assert len(sizes) == count and sum(sizes) == rows
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            assert max(sizes) == -(-rows // count)


@pytest.mark.parametrize("count", range(1, 8), ids=[f"split-{k}" for k in range(1, 8)])
def test_microbatches_cover_every_row_once_in_order(count: int) -> None:
    batch = eb.ElasticBatch.wrap({"i": torch.arange(10)})
    microbatches = list(batch.microbatches(count))
    assert torch.equal(torch.cat([mb.unwrap()["i"] for mb in microbatches]), torch.arange(10))
    assert [mb.index for mb in microbatches] == list(range(count))
    assert {mb.count for mb in microbatches} == {count}
    assert sum(mb.weight for mb in microbatches) == pytest.approx(1.0, abs=1e-12)
    assert [mb.weight for mb in microbatches] == [len(mb) / 10 for mb in microbatches]


def test_split_count_defaults_to_the_tag_and_is_capped_at_the_rows() -> None:
    batch = eb.ElasticBatch.wrap(torch.zeros(5, 2), split_count=2)
    assert [len(mb) for mb in batch.microbatches()] == [3, 2]
    assert [len(mb) for mb in batch.microbatches(9)] == [1] * 5
    assert {mb.count for mb in batch.microbatches(9)} == {5}


def test_wrap_returns_an_elastic_batch_as_it_is() -> None:
    batch = eb.ElasticBatch.wrap(torch.zeros(4, 2), split_count=3)
    assert eb.ElasticBatch.wrap(batch) is batch
    assert eb.ElasticBatch.wrap(batch, split_count=1).split_count == 3


def test_split_count_tag_can_be_changed() -> None:
    batch = eb.ElasticBatch.wrap(torch.zeros(4, 2))
    assert batch.split_count == 1
    batch.split_count = 4
    assert [len(mb) for mb in batch.microbatches()] == [1, 1, 1, 1]


def test_to_moves_fields_and_broadcast_tensors_and_keeps_the_tag() -> None:
    batch = eb.ElasticBatch.wrap(
        {"x": torch.zeros(4, 2), "scale": torch.tensor(2.0), "text": list("abcd")}, split_count=2
    )
    moved = batch.to("meta")
    assert moved is not batch and moved.split_count == 2 and len(moved) == 4
    out = moved.unwrap()
    assert out["x"].device.type == "meta" and out["scale"].device.type == "meta" and out["text"] == list("abcd")
    assert batch.unwrap()["x"].device.type == "cpu"  # the original stays where it was


class _Movable:
    """A per-sample object with a ``.to``, as PyG's ``Data``."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def to(self, device: Any) -> _Movable:
        return _Movable(self.value.to(device))


def test_to_moves_per_sample_objects_that_have_to_and_keeps_the_others() -> None:
    objects = [_Movable(torch.zeros(2)), "plain", _Movable(torch.ones(3)), {"id": 3}]
    batch = eb.ElasticBatch.wrap({"x": torch.zeros(4, 2), "objects": objects})
    for moved in (batch.to("meta").unwrap(), next(batch.microbatches(1)).to("meta").unwrap()):
        first, plain, third, meta = moved["objects"]
        assert first.value.device.type == "meta" and third.value.device.type == "meta"
        assert plain == "plain" and meta == {"id": 3}
    assert [mb.to("meta").unwrap()["objects"][0].value.device.type for mb in batch.microbatches(2)] == ["meta"] * 2
    assert objects[0].value.device.type == "cpu"  # the batch's own objects stay where they were


def test_repr_names_rows_tag_and_fields() -> None:
    batch = eb.ElasticBatch.wrap({"y": torch.zeros(3), "x": torch.zeros(3)}, split_count=2)
    assert repr(batch) == "ElasticBatch(rows=3, split_count=2, fields=['x', 'y'])"


def test_microbatch_repr_and_len() -> None:
    mb = next(eb.ElasticBatch.wrap(torch.zeros(10, 1)).microbatches(3))
    assert len(mb) == 4
    assert repr(mb) == "Microbatch(rows=4, weight=0.4, index=0, count=3)"
    assert mb.data.batch_size == torch.Size([4]) and mb.data["batch"].shape == (4, 1)


# ---------------------------------------------------------------------------------------------
# Errors


def test_empty_batch_cannot_be_split() -> None:
    batch = eb.ElasticBatch.wrap(torch.zeros(0, 3))
    with pytest.raises(ValueError, match=r"cannot split an empty batch \(0 rows\): check the DataLoader's sampler"):
        next(batch.microbatches(2))


@pytest.mark.parametrize("count", [0, -1, 1.5, True, "2"], ids=["zero", "negative", "float", "bool", "str"])
def test_microbatches_rejects_a_bad_split_count(count: Any) -> None:
    batch = eb.ElasticBatch.wrap(torch.zeros(4))
    with pytest.raises(ValueError, match=rf"split_count must be an int >= 1, got {count!r}"):
        next(batch.microbatches(count))


@pytest.mark.parametrize("count", [0, -3, 2.0, False, None], ids=["zero", "negative", "float", "bool", "none"])
def test_split_count_tag_rejects_bad_values(count: Any) -> None:
    with pytest.raises(ValueError, match=rf"ElasticBatch\.split_count must be an int >= 1, got {count!r}"):
        eb.ElasticBatch.wrap(torch.zeros(4), split_count=count)


@pytest.mark.parametrize(
    "data",
    [{"x": torch.zeros(3)}, torch.zeros(3), TensorDict({"x": torch.zeros(3)}, batch_size=[])],
    ids=["dict", "tensor", "tensordict-without-batch-dim"],
)
def test_constructor_rejects_data_that_is_not_a_batched_tensordict(data: Any) -> None:
    _, spec = to_tensordict(torch.zeros(3))
    with pytest.raises(TypeError, match=r"ElasticBatch expects a TensorDict with batch_size=\[B\] as data, got"):
        eb.ElasticBatch(data, spec)


# ---------------------------------------------------------------------------------------------
# Deferred batches (what the loader yields without workers) and flat fields


def test_a_deferred_batch_counts_rows_from_its_first_tensor_and_is_taken_apart_on_first_cut() -> None:
    x, names = torch.arange(10.0).view(5, 2), list("abcde")
    source = {"x": x, "names": names}
    batch = eb.ElasticBatch.deferred(source, split_count=2)
    assert len(batch) == 5 and batch.split_count == 2
    assert batch.unwrap() is source  # what the plain DataLoader yielded, not a rebuilt copy
    (whole,) = batch.microbatches(1)
    assert whole.unwrap() is source and whole.weight == 1.0
    pieces = [mb.unwrap() for mb in batch.microbatches()]
    assert [p["names"] for p in pieces] == [["a", "b", "c"], ["d", "e"]]
    assert torch.equal(torch.cat([p["x"] for p in pieces]), x)
    assert sorted(batch.fields) == ["names", "x"] and batch.data.batch_size == torch.Size([5])


def test_a_deferred_batch_that_cannot_be_split_raises_at_first_use_with_the_usual_message() -> None:
    batch = eb.ElasticBatch.deferred({"x": torch.zeros(4, 1), "y": torch.zeros(3)})
    assert len(batch) == 4  # read from the first tensor; the disagreement shows when the batch is taken apart
    with pytest.raises(ValueError, match=r"batch fields disagree on the batch size .*'x' \(4\), 'y' \(3\)"):
        next(batch.microbatches(2))
    with pytest.raises(TypeError, match=r"cannot split a batch of type object: register it"):
        len(eb.ElasticBatch.deferred(object()))


def test_data_shares_the_fields_tensors() -> None:
    batch = eb.ElasticBatch.wrap({"x": torch.zeros(4, 2), "names": list("abcd")})
    batch.data["x"].add_(1.0)  # in place: the microbatches see it
    assert [mb.unwrap()["x"].sum().item() for mb in batch.microbatches(2)] == [4.0, 4.0]
    assert batch.data.get("names").tolist() == list("abcd")


def test_from_fields_checks_the_rows_and_reweighted_keeps_the_rows() -> None:
    fields, spec, _ = flatten((torch.zeros(6, 2), list("abcdef")))
    batch = eb.ElasticBatch.from_fields(fields, spec, split_count=3)
    mb = next(batch.microbatches())
    assert mb.unwrap()[1] == ["a", "b"] and mb.reweighted(0.5).weight == 0.5
    assert mb.reweighted(0.5).unwrap()[1] == ["a", "b"]
    with pytest.raises(ValueError, match=r"ElasticBatch.from_fields: fields must all have the same rows"):
        eb.ElasticBatch.from_fields({"a": torch.zeros(2), "b": torch.zeros(3)}, spec)


def test_pickling_keeps_fields_spec_tag_and_drops_the_source() -> None:
    batch = eb.ElasticBatch.deferred((torch.arange(4), ["w", "x", "y", "z"]), split_count=2)
    restored = pickle.loads(pickle.dumps(batch))
    assert restored.split_count == 2 and len(restored) == 4
    assert [mb.unwrap()[1] for mb in restored.microbatches()] == [["w", "x"], ["y", "z"]]

"""``ElasticCollate`` and ``register_collate``: the worker-side collate and the registries it carries."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

import elastic_batches as eb
from elastic_batches import registry


class Point:
    def __init__(self, x: float) -> None:
        self.x = x


def collate_points(points: list[Point], *, collate_fn_map: Any = None) -> torch.Tensor:
    return torch.tensor([p.x for p in points])


class Boxed:
    def __init__(self, values: torch.Tensor) -> None:
        self.values = values


def boxed_fields(boxed: Boxed) -> dict[str, Any]:
    return {"values": boxed.values}


def boxed_rebuild(fields: dict[str, Any]) -> Boxed:
    return Boxed(fields["values"])


def collate_boxed(samples: list[int]) -> Boxed:
    return Boxed(torch.tensor(samples))


def test_default_collate_gives_a_tagged_elastic_batch() -> None:
    batch = eb.ElasticCollate()([{"x": torch.zeros(3), "y": 0, "name": "a"}, {"x": torch.ones(3), "y": 1, "name": "b"}])
    assert isinstance(batch, eb.ElasticBatch) and batch.split_count == 1 and len(batch) == 2
    out = batch.unwrap()
    assert out["y"].tolist() == [0, 1] and out["name"] == ["a", "b"] and out["x"].shape == (2, 3)


def test_user_collate_fn_is_called_and_its_result_taken_apart() -> None:
    seen = []

    def collate_fn(samples: list[int]) -> tuple[torch.Tensor, list[str]]:
        seen.append(samples)
        return torch.tensor(samples), [str(s) for s in samples]

    batch = eb.ElasticCollate(collate_fn)([3, 4, 5])
    assert seen == [[3, 4, 5]]
    assert [mb.unwrap()[1] for mb in batch.microbatches(2)] == [["3", "4"], ["5"]]


def test_without_automatic_batching_the_dataset_batch_is_converted() -> None:
    batch = eb.ElasticCollate(auto_collation=False)({"x": torch.arange(4), "names": list("abcd")})
    assert batch.unwrap()["x"].tolist() == [0, 1, 2, 3] and len(batch) == 4


def test_wrapping_an_elastic_collate_does_not_nest() -> None:
    inner = eb.ElasticCollate(collate_boxed)
    assert eb.ElasticCollate(inner).collate_fn is collate_boxed


def test_register_collate_extends_the_default_collate() -> None:
    eb.register_collate(Point, collate_points)
    batch = eb.ElasticCollate()([{"p": Point(1.0), "i": 0}, {"p": Point(2.0), "i": 1}])
    assert batch.unwrap()["p"].tolist() == [1.0, 2.0]


def test_pickled_collate_carries_both_registries_into_a_fresh_process() -> None:
    eb.register_collate(Point, collate_points)
    eb.register_batch_type(Boxed, to_tensordict=boxed_fields, from_tensordict=boxed_rebuild)
    eb.register_collate(float, lambda values, *, collate_fn_map=None: torch.tensor(values))  # cannot travel
    payload = pickle.dumps(eb.ElasticCollate(collate_boxed))
    registry._BATCH_TYPES.clear()  # as in a spawn worker that never ran the registrations
    registry._COLLATE_FNS.clear()
    worker_side = pickle.loads(payload)
    assert set(registry._BATCH_TYPES) == {Boxed} and set(registry._COLLATE_FNS) == {Point}
    batch = worker_side([1, 2, 3])
    assert [mb.unwrap().values.tolist() for mb in batch.microbatches(2)] == [[1, 2], [3]]
    assert eb.ElasticCollate()([{"p": Point(3.0)}]).unwrap()["p"].tolist() == [3.0]


def test_registrations_of_the_receiving_process_win() -> None:
    eb.register_batch_type(Boxed, to_tensordict=boxed_fields, from_tensordict=boxed_rebuild)
    payload = pickle.dumps(eb.ElasticCollate())
    local = registry._BATCH_TYPES[Boxed]
    pickle.loads(payload)
    assert registry._BATCH_TYPES[Boxed] is local


def test_unsplittable_collate_result_names_the_type_and_register_batch_type() -> None:
    batch = eb.ElasticCollate(collate_boxed)([1, 2])  # in the main process: taken apart on first use
    with pytest.raises(TypeError, match=r"cannot split a batch of type Boxed: register it with .*register_batch_type"):
        next(batch.microbatches(2))
    loader = eb.MicrobatchingDataLoader([1, 2, 3, 4], batch_size=2, collate_fn=collate_boxed)
    with pytest.raises(TypeError, match=r"cannot split a batch of type Boxed: register it with .*register_batch_type"):
        next(iter(loader))  # the loader takes its first batch apart before yielding it


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: eb.ElasticCollate(collate_fn=3), r"ElasticCollate: collate_fn must be callable or None, got 3"),
        (lambda: eb.register_collate("Point", collate_points), r"register_collate expects a class, got 'Point'"),
        (lambda: eb.register_collate(Point, None), r"register_collate\(Point\): collate_fn must be callable, got None"),
    ],
    ids=["collate-fn", "register-not-a-class", "register-not-callable"],
)
def test_bad_arguments_are_named(call: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        call()


def test_variable_length_tensors_without_pad_values_name_the_fix() -> None:
    loader = eb.MicrobatchingDataLoader([{"ids": torch.ones(2)}, {"ids": torch.ones(3)}], batch_size=2)
    with pytest.raises(RuntimeError, match=r"different lengths.*pad_values=.*TrimPadding"):
        next(iter(loader))

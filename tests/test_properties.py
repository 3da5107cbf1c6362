"""Property-based bad input: any nesting of supported structures splits and trains exactly.

Each generated batch either works — microbatches put back together give the batch, and the
gradient equals the unsplit one — or raises the documented error naming the offending field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import elastic_batches as eb

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclasses.dataclass
class Record:
    features: Any
    extra: Any


def _leaf(rows: int, kind: str, seed: int) -> Any:
    generator = torch.Generator().manual_seed(seed)
    if kind == "tensor":
        return torch.randn(rows, 3, generator=generator)
    if kind == "non_contiguous":
        return torch.randn(3, rows, generator=generator).t()
    if kind == "zero_stride":
        return torch.randn(1, 2, generator=generator).expand(rows, 2)
    if kind == "requires_grad":
        return torch.randn(rows, 2, generator=generator).requires_grad_()
    if kind == "ints":
        return torch.arange(rows)
    if kind == "strings":
        return [f"sample {i}" for i in range(rows)]
    if kind == "constant":
        return 0.5
    return torch.tensor(2.0)  # a 0-d tensor: broadcast


LEAF_KINDS = ["tensor", "non_contiguous", "zero_stride", "requires_grad", "ints", "strings", "constant", "scalar"]


@st.composite
def batches(draw: st.DrawFn, rows: int) -> Any:
    counter = iter(range(10_000))

    def node(depth: int) -> Any:
        if depth >= 3 or (depth and draw(st.booleans())):
            return _leaf(rows, draw(st.sampled_from(LEAF_KINDS)), next(counter))
        kind = draw(st.sampled_from(["dict", "list", "tuple", "dataclass"]))
        width = draw(st.integers(1, 3))
        children = [node(depth + 1) for _ in range(width)]
        # at least one child must carry the batch dimension for a container list to be a container
        children.append(_leaf(rows, "tensor", next(counter)))
        if kind == "dict":
            return {f"k{i}": child for i, child in enumerate(children)}
        if kind == "list":
            return children
        if kind == "tuple":
            return tuple(children)
        return Record(children[0], children[1:])

    return node(0)


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for child in value.values() for leaf in _leaves(child)]
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], str):
        return [leaf for child in value for leaf in _leaves(child)]
    if isinstance(value, Record):
        return _leaves(value.features) + _leaves(value.extra)
    return [value]


def _float_fields(value: Any) -> list[torch.Tensor]:
    leaves = _leaves(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.is_floating_point()]


def _loss(batch: Any, weight: torch.Tensor) -> torch.Tensor:
    """A mean over rows of a function of every float field (and of the weight)."""
    rows = sum(field.reshape(field.shape[0], -1).sum(1) for field in _float_fields(batch))
    return ((rows * weight).tanh() ** 2).mean()


@SETTINGS
@given(rows=st.integers(1, 7), split_count=st.integers(1, 9), data=st.data())
def test_any_nested_batch_splits_back_into_itself(rows: int, split_count: int, data: st.DataObject) -> None:
    batch = data.draw(batches(rows))
    elastic = eb.ElasticBatch.wrap(batch)
    pieces = [mb.unwrap() for mb in elastic.microbatches(split_count)]
    assert len(pieces) == min(split_count, rows)  # more pieces than rows is capped at the rows
    assert type(pieces[0]) is type(batch)
    for original, *parts in zip(_leaves(batch), *(_leaves(p) for p in pieces), strict=True):
        if isinstance(original, torch.Tensor) and original.dim():
            torch.testing.assert_close(torch.cat(parts), original.detach(), rtol=0, atol=0)
        elif isinstance(original, list):
            assert [item for part in parts for item in part] == original
        else:
            assert all(part is original or part == original for part in parts)  # broadcast as it is


@SETTINGS
@given(
    rows=st.integers(2, 7),
    split_count=st.integers(1, 9),
    oom_at=st.one_of(st.none(), st.integers(0, 6)),
    data=st.data(),
)
def test_any_nested_batch_gives_the_unsplit_gradient(
    rows: int, split_count: int, oom_at: int | None, data: st.DataObject
) -> None:
    batch = data.draw(batches(rows))
    weight = torch.nn.Parameter(torch.tensor(0.3))
    model = torch.nn.Module()
    model.weight = weight
    inputs = [f for f in _float_fields(batch) if f.requires_grad]
    reference = torch.autograd.grad(_loss(batch, weight), [weight, *inputs])
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=min(split_count, rows - 1)))
    calls = iter(range(100))

    def loss_fn(mb: Any) -> torch.Tensor:
        loss = _loss(mb, weight)
        if next(calls) == oom_at:  # after the forward: a partial backward may be left behind
            loss.backward(retain_graph=True)
            raise torch.OutOfMemoryError("CUDA out of memory (property test)")
        return loss

    step.backward(batch, loss_fn)
    torch.testing.assert_close(weight.grad, reference[0], rtol=1e-5, atol=1e-7)
    for field, expected in zip(inputs, reference[1:], strict=True):  # batch tensors that require grad
        torch.testing.assert_close(field.grad, expected, rtol=1e-5, atol=1e-7)


@SETTINGS
@given(rows=st.integers(1, 6), data=st.data())
def test_a_field_with_another_leading_dimension_is_named(rows: int, data: st.DataObject) -> None:
    batch = {"good": data.draw(batches(rows)), "bad": torch.zeros(rows + 1, 2)}
    with pytest.raises(ValueError, match=rf"disagree on the batch size.*'bad' \({rows + 1}\)"):
        eb.ElasticBatch.wrap(batch)


def test_zero_row_batch_is_refused_clearly() -> None:
    model = torch.nn.Linear(2, 1)
    step = eb.ElasticStep(model)
    with pytest.raises(ValueError, match=r"the batch is empty \(0 rows\)"):
        step.backward(torch.zeros(0, 2), lambda mb: model(mb).mean())


def test_a_single_sample_that_does_not_fit_raises_an_oom_naming_the_batch() -> None:
    model = torch.nn.Linear(2, 1)
    step = eb.ElasticStep(model)

    def loss_fn(mb: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    with pytest.raises(eb.ElasticOOMError, match=r"batch of 1 rows even at microbatch size 1"):
        step.backward(torch.zeros(1, 2), loss_fn)
    assert model.weight.grad is None


def test_an_unsplittable_leaf_names_its_field_and_the_fix() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"Opaque \(field 'meta.inner'\).*register_batch_type"):
        eb.ElasticBatch.wrap({"x": torch.zeros(2, 1), "meta": {"inner": Opaque()}})

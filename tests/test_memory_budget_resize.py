"""``MemoryBudget`` counts storage resizes, which FSDP2 uses to free and re-allocate unsharded parameters.

A dispatch mode never sees ``untyped_storage().resize_()``. The budget counts the bytes a
storage gains inside it as allocated and those it loses as freed, and raises its OOM at a resize
past the limit. Checked on plain storages, then on FSDP2 (two gloo ranks) against a direct count
of the storages FSDP2 holds.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from elastic_batches.testing import MemoryBudget

from support.ranks import RankPool


def test_a_storage_from_before_the_budget_counts_what_it_regains_after_being_freed() -> None:
    kept = torch.zeros(100)  # 400 bytes, never counted
    budget = MemoryBudget()
    with budget:
        kept.untyped_storage().resize_(0)
        assert budget.live_bytes == 0  # nothing counted to free
        kept.untyped_storage().resize_(400)
        assert budget.live_bytes == 400
        kept.untyped_storage().resize_(0)
        assert budget.live_bytes == 0
    assert budget.peak_bytes == 400


def test_a_storage_from_before_the_budget_that_grows_counts_the_growth_only() -> None:
    kept = torch.zeros(100)
    with MemoryBudget() as budget:
        kept.untyped_storage().resize_(600)
        assert budget.live_bytes == 200
        kept.untyped_storage().resize_(300)  # below what it had: its counted bytes go first
        assert budget.live_bytes == 0


def test_a_storage_made_inside_is_freed_by_a_resize_to_zero_and_when_it_dies() -> None:
    with MemoryBudget() as budget:
        t = torch.zeros(50)
        t.untyped_storage().resize_(0)
        assert budget.live_bytes == 0
        t.untyped_storage().resize_(120)
        assert budget.live_bytes == 120
    del t
    assert budget.live_bytes == 0


def test_a_resize_past_the_limit_raises_before_the_storage_changes() -> None:
    kept = torch.zeros(100)
    budget = MemoryBudget(limit_bytes=500)
    with budget:
        kept.untyped_storage().resize_(0)
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 600 bytes.*storage resize"):
            kept.untyped_storage().resize_(600)
    assert (kept.untyped_storage().nbytes(), budget.live_bytes, budget.oom_count) == (0, 0, 1)


def test_nested_budgets_both_count_a_resize_and_the_patch_leaves_with_the_last() -> None:
    original = torch.UntypedStorage.resize_
    kept = torch.zeros(10)
    kept.untyped_storage().resize_(0)
    with MemoryBudget() as outer:
        with MemoryBudget() as inner:
            kept.untyped_storage().resize_(40)
        assert torch.UntypedStorage.resize_ is not original
    assert (outer.live_bytes, inner.live_bytes) == (40, 40)
    assert torch.UntypedStorage.resize_ is original


def test_a_resize_outside_any_budget_is_not_counted() -> None:
    budget = MemoryBudget()
    with budget:
        t = torch.zeros(10)
    t.untyped_storage().resize_(400)  # outside the mode
    assert budget.live_bytes == 40


# -- FSDP2, two gloo ranks: against a direct count of FSDP2's storages -------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankPool]:
    pool = RankPool(tmp_path_factory.mktemp("resize-ranks"), world_size=2)
    yield pool
    pool.close()


def _sharded(width: int = 64, units: int = 4) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(units)])
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _unsharded_bytes(module: Any) -> int:
    """Bytes of the storages of ``module``'s own unsharded parameters that are allocated now (FSDP2 internals)."""
    from elastic_batches.distributed.fsdp2 import param_groups

    storages = {}
    for group in param_groups(module):
        for fp in group.fsdp_params:
            for t in fp.all_gather_outputs:
                storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _live_once_released(budget: MemoryBudget, expected: int) -> int:
    """``budget.live_bytes`` once it reads ``expected``, or after a second: gloo's worker thread drops its
    reference to the all-gather's flat buffer a moment after the collective's wait returns."""
    deadline = time.monotonic() + 1.0
    while budget.live_bytes != expected and time.monotonic() < deadline:
        time.sleep(0.001)
        gc.collect()
    return budget.live_bytes


def _direct_count(rank: int, world: int) -> dict[str, Any]:
    model = _sharded()
    units = list(model)
    x = torch.randn(2, 64)
    model(x).sum().backward()  # FSDP2's lazy init and first all-gathers happen outside the budget
    for p in model.parameters():
        p.grad = None
    budget = MemoryBudget()
    unsharded = []
    with budget:
        for unit in units:
            unit.unshard()
            gc.collect()  # the all-gather's buffer, freed by FSDP2, can wait in a reference cycle
            direct = sum(_unsharded_bytes(u) for u in units)
            unsharded.append((_live_once_released(budget, direct), direct))
        for unit in units:
            unit.reshard()
        gc.collect()
        after_reshard = budget.live_bytes
        budget.reset_peak()
        model(x).sum().backward()
        gc.collect()  # what FSDP2's backward freed but left in reference cycles
    grads = {}  # the reduce-scatter output each unit's sharded gradients are views of
    for p in model.parameters():
        storage = p.grad.to_local().untyped_storage()
        grads[storage._cdata] = storage.nbytes()
    return {
        "unsharded": unsharded,
        "after_reshard": after_reshard,
        "after_step": budget.live_bytes,
        "grads": sum(grads.values()),
        "peak": budget.peak_bytes,
        "one_unit": 4 * (64 * 64 + 64),
    }


def test_fsdp2_unsharded_parameters_are_counted_while_allocated_and_freed_when_resharded(ranks: RankPool) -> None:
    for result in ranks.run(_direct_count, timeout=60):
        for live, direct in result["unsharded"]:
            assert live == direct  # every unit unsharded so far, as FSDP2 holds them
        assert result["unsharded"][-1][1] == 4 * result["one_unit"]
        assert result["after_reshard"] == 0
        assert result["after_step"] == result["grads"]  # what a step leaves: the sharded gradients
        # a step holds a unit or two unsharded at a time, never the whole model's parameters and gradients
        assert result["peak"] < 2 * 4 * result["one_unit"]


def _oom_in_resize(rank: int, world: int) -> str:
    model = _sharded()
    model(torch.randn(2, 64)).sum().backward()
    unit = model[0]
    all_gather_output = 4 * (64 * 64 + 64)  # world x each rank's shard: the all-gather's buffer, then freed
    budget = MemoryBudget(limit_bytes=all_gather_output + 1024)  # the buffer fits, it and the parameters not
    try:
        with budget:
            unit.unshard()
    except torch.OutOfMemoryError as err:
        message = str(err)
    else:
        message = "no OOM"
    model.reset_iter_state()
    return message


def test_fsdp2_unsharding_past_the_limit_raises_at_the_storage_resize(ranks: RankPool) -> None:
    for message in ranks.run(_oom_in_resize, timeout=60):
        assert "storage resize" in message

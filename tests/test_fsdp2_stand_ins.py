"""FSDP2 per module, scripted: how a rank that failed stands in for its script's collectives (issue 25).

A rank whose scripted attempt fails starts the collectives its peers still start. Its stand-ins
use the op, dtype and group of the collective each replaces (under HSDP, the reduce-scatter's and
the all-reduce's ops as FSDP2 chose them), from one buffer per dtype of the largest size the rest
needs, allocated once per failed attempt. When even that buffer runs out of memory, the peers wait
in the collective it does not start until the process group's timeout, then every rank raises a
``RuntimeError`` naming the rank and that collective (never a silent hang).

Two gloo ranks (four for HSDP); the model has four FSDP2 units under an FSDP2 root; each case's
third step (``SCRIPTED_STEP``) follows the script its first two agreed on.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import elastic_batches as eb
from elastic_batches.distributed.guard import CollectiveGuard
from elastic_batches.testing import inject_oom, inject_oom_in_stand_in

from support.ranks import RankPool

RTOL = 1e-5
LR = 0.1
SPLIT = 3
SCRIPTED_STEP = 2
UNITS = (0, 2, 4, 6)
_MESHES: dict[tuple[int, ...], Any] = {}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankPool]:
    pool = RankPool(tmp_path_factory.mktemp("stand-in-ranks"), world_size=2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankPool]:
    pool = RankPool(tmp_path_factory.mktemp("stand-in-hsdp"), world_size=4)
    yield pool
    pool.close()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )


def _mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _MESHES:
        names = ("replicate", "shard") if len(shape) == 2 else None
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[shape]


def _shard(model: nn.Sequential, mesh: Any) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    for index in UNITS:
        fully_shard(model[index], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(12, 6, generator=generator)
    return x, x[:, :1].sin() + 0.1 * torch.randn(12, 1, generator=generator)


class _Watch:
    """Records, apart for FSDP2's passes and for the stand-ins, the collectives' ops and the buffers allocated."""

    def __init__(self) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

        self.phase = "fsdp2"
        self.ops: dict[str, set[tuple[str, str, torch.dtype]]] = {"fsdp2": set(), "stand-in": set()}
        self.allocations: list[tuple[int, torch.dtype]] = []  # during the stand-ins
        self._saved = [
            (DefaultReduceScatter, "__call__", DefaultReduceScatter.__call__),
            (DefaultAllGather, "allocate", DefaultAllGather.allocate),
            (DefaultReduceScatter, "allocate", DefaultReduceScatter.allocate),
            (CollectiveGuard, "stand_in", CollectiveGuard.stand_in),
            (dist, "all_reduce", dist.all_reduce),
        ]
        watch = self
        reduce_scatter, all_gather_allocate, reduce_scatter_allocate, stand_in, all_reduce = (
            saved[2] for saved in self._saved
        )

        def call(comm: Any, **kwargs: Any) -> Any:
            watch.ops[watch.phase].add(("reduce-scatter", str(kwargs["op"]), kwargs["input_tensor"].dtype))
            return reduce_scatter(comm, **kwargs)

        def allocating(original: Any) -> Any:
            def allocate(comm: Any, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
                if watch.phase == "stand-in":
                    watch.allocations.append((int(torch.Size(size).numel()), dtype))
                return original(comm, size, dtype=dtype, device=device)

            return allocate

        def standing_in(guard: CollectiveGuard) -> None:
            watch.phase = "stand-in"
            try:
                stand_in(guard)
            finally:
                watch.phase = "fsdp2"

        def reducing(
            tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
        ) -> Any:
            watch.ops[watch.phase].add(("all-reduce", str(op), tensor.dtype))
            return all_reduce(tensor, op=op, group=group, async_op=async_op)

        DefaultReduceScatter.__call__ = call  # type: ignore[method-assign]
        DefaultAllGather.allocate = allocating(all_gather_allocate)  # type: ignore[method-assign]
        DefaultReduceScatter.allocate = allocating(reduce_scatter_allocate)  # type: ignore[method-assign]
        CollectiveGuard.stand_in = standing_in  # type: ignore[method-assign]
        dist.all_reduce = reducing

    def remove(self) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)


def _standing_in(rank: int, world: int, failing: int) -> dict[str, Any]:
    """Three steps; in the scripted one, rank ``failing`` runs out of memory in unit 1's forward of microbatch 1."""
    mesh = _mesh((world,) if world == 2 else (2, world // 2))
    model = _shard(_model(), mesh)
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=SPLIT), gather="module")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    watch = _Watch()
    try:
        for i in range(SCRIPTED_STEP + 1):
            optimizer.zero_grad(set_to_none=True)
            calls = [1] if i == SCRIPTED_STEP else []
            with inject_oom(model[UNITS[1]], phase="forward", calls=calls or [10**6], rank=failing):
                step.backward(_batch(i, rank), lambda mb: nn.functional.mse_loss(model(mb[0]), mb[1]))
            optimizer.step()
    finally:
        watch.remove()
    script = step.sync.scripts.script(("backward", True, SPLIT))  # the scripted attempt's
    largest = max(c.buffer_numel for c in script.collectives) if script is not None else 0
    return {
        "ops": {phase: sorted(map(str, ops)) for phase, ops in watch.ops.items()},
        "allocations": watch.allocations,
        "largest": largest,
        "stood_in": step.sync.guard.stood_in,
        "ooms": step.controller.oom_count,
    }


@pytest.mark.parametrize("world", [2, 4], ids=["2-ranks", "hsdp-4-ranks"])
def test_stand_ins_use_fsdp2s_ops_from_one_buffer_allocated_once(
    ranks: RankPool, four_ranks: RankPool, world: int
) -> None:
    pool = ranks if world == 2 else four_ranks
    failing = 1
    results = pool.run(_standing_in, failing, timeout=120)
    for rank, result in enumerate(results):
        assert result["ooms"] == 1, f"rank {rank}: every rank learned of the OOM"
        if rank != failing:
            assert result["stood_in"] == 0 and result["allocations"] == []
            continue
        assert result["stood_in"] > 0
        # the reduce-scatters' (and HSDP's all-reduces') ops are those FSDP2 used
        assert set(result["ops"]["stand-in"]) <= set(result["ops"]["fsdp2"]), result["ops"]
        assert any("all-reduce" in op for op in result["ops"]["stand-in"]) == (world == 4)
        # one float32 buffer, as large as the largest collective of the rest of the script needs
        assert len(result["allocations"]) == 1, result["allocations"]
        numel, dtype = result["allocations"][0]
        assert dtype == torch.float32 and 0 < numel <= result["largest"]


def _stand_in_out_of_memory(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 fails in the scripted step and cannot allocate its stand-ins' buffer; the mesh's timeout is 5 s."""
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=5))
    model = _shard(_model(), DeviceMesh.from_group(group, "cpu"))
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=SPLIT), gather="module")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    error = ""
    for i in range(SCRIPTED_STEP + 1):
        optimizer.zero_grad(set_to_none=True)
        failing = i == SCRIPTED_STEP
        with (
            inject_oom(model[UNITS[1]], phase="forward", calls=[1] if failing else [10**6], rank=1),
            inject_oom_in_stand_in(rank=1 if failing else 10**6) as oom,
        ):
            try:
                step.backward(_batch(i, rank), lambda mb: nn.functional.mse_loss(model(mb[0]), mb[1]))
            except RuntimeError as err:
                error = str(err)
                break
        optimizer.step()
    dist.barrier()  # every rank got here: none waits
    return {"error": error, "fired": oom.fired, "step": i}


def test_an_oom_in_a_stand_in_raises_on_every_rank_naming_it(ranks: RankPool) -> None:
    """Rank 0 waits in the all-gather rank 1 cannot start until the 5 s timeout; then both raise, naming it."""
    results = ranks.run(_stand_in_out_of_memory, timeout=120)
    assert [r["fired"] for r in results] == [0, 1]
    for result in results:
        assert result["step"] == SCRIPTED_STEP
        assert re.search(
            r"out of memory standing in for FSDP2 collectives after a failed attempt: rank 1 at the all-gather of "
            r"\d+ torch.float32 elements of unit \d \('\d'\) \(position \d+ of the attempt's script\)",
            result["error"],
        ), result["error"]

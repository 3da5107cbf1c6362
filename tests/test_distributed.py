"""Distributed ElasticStep: 2 gloo ranks, DDP and FSDP2.

Every case runs on two spawned ranks (``support.ranks.RankPool``) under a 60 s
deadline: a hang fails the test with each rank's stack instead of freezing the suite. The
reference for every result is plain full-batch training on the union of both ranks' batches,
computed on each rank in float32; weights must match it within ``RTOL``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import re
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import elastic_batches as eb
from elastic_batches import distributed
from elastic_batches.testing import MemoryBudget, inject_oom, inject_oom_in_optimizer

from support.ranks import RankFailure, RankPool

RTOL = 1e-5
LR = 0.1
KINDS = ["ddp", "fsdp"]
_MESH: Any = None


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankPool]:
    pool = RankPool(tmp_path_factory.mktemp("ranks"), world_size=2)
    yield pool
    pool.close()


# -- helpers that run on the ranks -------------------------------------------------------------


def _plain_model(seed: int = 0, width: int = 16, batch_norm: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(6, width), nn.Tanh()]
    if batch_norm:
        layers.append(nn.BatchNorm1d(width))
    layers += [nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)]
    return nn.Sequential(*layers)


def _mesh() -> Any:
    """The ranks' 1-D device mesh, made once per rank process."""
    from torch.distributed.device_mesh import init_device_mesh

    global _MESH
    if _MESH is None:
        _MESH = init_device_mesh("cpu", (dist.get_world_size(),))
    return _MESH


def _distribute(kind: str, model: nn.Module, **kwargs: Any) -> nn.Module:
    """DDP, or FSDP2 on each linear layer and on the root (``kwargs`` go to DDP or to every ``fully_shard``).

    ``"fsdp-tutorial"`` shards as PyTorch's FSDP2 tutorial writes it: no ``mesh=`` anywhere, so
    every ``fully_shard`` call makes its own (equal) default mesh.
    """
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model, **kwargs)
    from torch.distributed.fsdp import fully_shard

    if kind == "fsdp-tutorial":
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, **kwargs)
        return fully_shard(model, **kwargs)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=_mesh(), **kwargs)
    return fully_shard(model, mesh=_mesh(), **kwargs)


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _batch(step: int, rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(rows, 6, generator=generator)
    return x, x[:, :1].sin() + 0.1 * torch.randn(rows, 1, generator=generator)


def _union_batch(step: int, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's batch of ``step``, concatenated in rank order: what full-batch training sees."""
    x, y = zip(*(_batch(step, r, n) for r, n in enumerate(rows)), strict=True)
    return torch.cat(x), torch.cat(y)


def _loss_fn(model: nn.Module):
    def loss_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = mb
        return nn.functional.mse_loss(model(x), y)

    return loss_fn


def _full(tensors: Iterator[torch.Tensor]) -> torch.Tensor:
    """Every parameter, whole (a collective for FSDP2: every rank calls it alike)."""
    parts = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in tensors]
    return torch.cat([p.detach().reshape(-1) for p in parts])


def _reference(rows: list[int], steps: int, seed: int = 0, batch_norm: bool = False) -> torch.Tensor:
    """Plain full-batch SGD on the union of every rank's batch, every step."""
    model = _plain_model(seed, batch_norm=batch_norm)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = _union_batch(step, rows)
        optimizer.zero_grad()
        _loss_fn(model)((x, y)).backward()
        optimizer.step()
    return _full(model.parameters())


def _learned(state: dict[str, Any]) -> dict[str, Any]:
    """A controller's state without ``discarded_microbatches``: each rank counts the work it threw away itself."""
    return {k: v for k, v in state.items() if k != "discarded_microbatches"}


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _injections(model: nn.Module, plan: list[tuple[str, str, list[int], int]]) -> list[Any]:
    """``(phase, target, calls, rank)``: target ``"model"`` or ``"first"`` (the first layer: a partial backward)."""
    inner = _inner(model)
    handles = []
    for phase, target, calls, rank in plan:
        module = inner if target == "model" else inner[0]
        handles.append(inject_oom(module, phase=phase, calls=calls, rank=rank))  # type: ignore[arg-type]
    return handles


def _train(
    rank: int,
    world: int,
    kind: str,
    *,
    rows: list[int],
    steps: int = 3,
    split_count: int = 3,
    plan: list[tuple[str, str, list[int], int]] | None = None,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    model = _distribute(kind, _plain_model(), **(options or {}))
    controller = eb.SplitController(split_count=split_count)
    step = eb.ElasticStep(model, controller=controller)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    handles = _injections(model, plan or [])
    counts = []
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step.backward(_batch(i, rank, rows[rank]), _loss_fn(model))
        optimizer.step()
        counts.append(controller.split_count)
    fired = [h.fired for h in handles]
    for h in handles:
        h.remove()
    weights = _full(model.parameters())
    return {
        "error": _relative_error(weights, _reference(rows, steps)),
        "counts": counts,
        "state": controller.state_dict(),
        "fired": fired,
        "oom_count": controller.oom_count,
    }


# -- exactness -------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [[12, 12], [12, 7]], ids=["same-batch", "different-batches"])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_full_batch_training_on_the_union(ranks: RankPool, kind: str, rows: list[int]) -> None:
    results = ranks.run(_train, kind, timeout=60, rows=rows)
    for rank, result in enumerate(results):
        assert result["error"] <= RTOL, f"rank {rank}: relative weight error {result['error']:.2e}"
        assert result["oom_count"] == 0


# -- an OOM on one rank, or on both at different microbatches: no hang, same count, same weights --

OOM_PLANS = {
    # 12 rows in 3 microbatches of 4; forward calls are numbered from 0 over the run
    "forward-first-rank1": [("forward", "model", [0], 1)],
    "forward-middle-rank1": [("forward", "model", [1], 1)],
    "forward-last-rank0": [("forward", "model", [2], 0)],
    "backward-middle-rank1": [("backward", "first", [1], 1)],
    "backward-last-rank1": [("backward", "first", [2], 1)],
    "both-ranks-same-attempt": [("forward", "model", [1], 0), ("backward", "first", [2], 1)],
    "both-ranks-successive-attempts": [("forward", "model", [1], 0), ("backward", "first", [4], 1)],
}


@pytest.mark.parametrize("plan", list(OOM_PLANS.values()), ids=list(OOM_PLANS))
@pytest.mark.parametrize("kind", KINDS)
def test_oom_on_some_ranks_retries_everywhere(ranks: RankPool, kind: str, plan: list[Any]) -> None:
    results = ranks.run(_train, kind, timeout=60, rows=[12, 12], plan=plan)
    assert [sum(r["fired"]) for r in results] == [sum(1 for p in plan if p[3] == rank) for rank in range(2)]
    assert results[0]["counts"] == results[1]["counts"]
    assert results[0]["counts"][0] > 3, "the OOM raised the split count"
    assert _learned(results[0]["state"]) == _learned(results[1]["state"])
    for rank, result in enumerate(results):
        assert result["error"] <= RTOL, f"rank {rank}: relative weight error {result['error']:.2e}"


@pytest.mark.parametrize("plan", ["forward-middle-rank1", "backward-last-rank1"])
def test_fsdp2_as_the_tutorial_writes_it_trains_exactly_through_an_oom_on_one_rank(ranks: RankPool, plan: str) -> None:
    results = ranks.run(_train, "fsdp-tutorial", timeout=60, rows=[12, 12], plan=OOM_PLANS[plan])
    assert [sum(r["fired"]) for r in results] == [0, 1]
    assert results[0]["counts"] == results[1]["counts"] and results[0]["counts"][0] > 3
    for rank, result in enumerate(results):
        assert result["error"] <= RTOL, f"rank {rank}: relative weight error {result['error']:.2e}"


def _ddp_step_with_a_retry(rank: int) -> tuple[Any, int]:
    """A DDP step that retries once (an OOM rank 1's loss raises); a weak reference to the DDP model, the split."""
    model = nn.parallel.DistributedDataParallel(_plain_model())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=1))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    failed = False

    def loss_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        nonlocal failed
        if rank == 1 and not failed:
            failed = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (raised by the test)")
        return nn.functional.mse_loss(model(mb[0]), mb[1])

    step.backward((torch.randn(8, 6), torch.randn(8, 1)), loss_fn)
    step.optimizer_step(optimizer)
    return weakref.ref(model), step.controller.split_count


def _drop_a_ddp_step(rank: int, world: int) -> tuple[bool, int]:
    """Whether the DDP model outlived its step without a collection, and the split the ranks agreed on."""
    gc.collect()
    gc.disable()
    try:
        alive, split_count = _ddp_step_with_a_retry(rank)
        return alive() is not None, split_count
    finally:
        gc.enable()


def test_a_dropped_ddp_step_frees_the_model_and_its_hold_on_the_process_group(ranks: RankPool) -> None:
    """Else ``destroy_process_group`` leaves gloo's threads running into the interpreter's exit, which can abort."""
    assert ranks.run(_drop_a_ddp_step, timeout=60) == [(False, 2), (False, 2)]


@pytest.mark.parametrize("option", ["gradient_as_bucket_view", "find_unused_parameters"])
def test_ddp_options_that_change_nothing_here_keep_the_update_exact(ranks: RankPool, option: str) -> None:
    """DDP's own reduction is not used: its options for it leave the result as without them, OOM included."""
    plan = OOM_PLANS["backward-middle-rank1"]
    results = ranks.run(_train, "ddp", timeout=60, rows=[12, 7], plan=plan, options={option: True})
    assert results[1]["fired"] == [1]
    for rank, result in enumerate(results):
        assert result["error"] <= RTOL, f"rank {rank}: relative weight error {result['error']:.2e}"


@pytest.mark.parametrize("kind", KINDS)
def test_oom_with_different_batch_sizes(ranks: RankPool, kind: str) -> None:
    results = ranks.run(_train, kind, timeout=60, rows=[12, 7], plan=[("backward", "first", [1], 1)])
    assert results[1]["fired"] == [1]
    for rank, result in enumerate(results):
        assert result["error"] <= RTOL, f"rank {rank}: relative weight error {result['error']:.2e}"
    shared = ("fits", "fails", "oom_count", "retry_count")
    assert [results[0]["state"][k] for k in shared] == [results[1]["state"][k] for k in shared]


def _final_oom(step: eb.ElasticStep, model: nn.Module, batch: Any, stage: str) -> dict[str, Any]:
    """Run ``stage`` (``backward`` or ``evaluate``) on ``batch``; the final OOM's message, and the retries."""
    try:
        if stage == "backward":
            step.backward(batch, _loss_fn(model))
        else:
            with torch.no_grad():
                step.evaluate(batch[0], model)
    except eb.ElasticOOMError as err:
        return {"raised": str(err), "retries": step.controller.retry_count}
    return {"raised": None}


def _padded_batch(rank: int, rows: int) -> eb.ElasticBatch:
    """This rank's rows of ``_batch(0, ...)`` with a ragged field, padded as a loader with ``pad_values`` pads it."""
    x, y = _batch(0, rank, rows)
    samples = [{"x": x[i], "y": y[i], "ids": torch.ones(1 + i % 4)} for i in range(rows)]
    return eb.ElasticCollate(pad_values={"ids": 0.0})(samples)


def _evaluate_through_ooms(rank: int, world: int, kind: str) -> dict[str, Any]:
    """``evaluate`` with an OOM in rank 1's padded cut, then one in rank 0's combine of the retry's outputs."""
    from elastic_batches.testing import inject_oom_in_cut

    model = _distribute(kind, _plain_model())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    batch = _padded_batch(rank, 12)
    combined = [0]

    def combine(outputs: list[torch.Tensor], microbatches: list[eb.Microbatch]) -> torch.Tensor:
        combined[0] += 1
        if rank == 0 and combined[0] == 2:  # in the retry that rank 1's OOM caused
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test's combine)")
        return torch.cat(outputs)

    with torch.no_grad(), inject_oom_in_cut(calls=1, rank=1):
        out = step.evaluate(batch, lambda mb: model(mb["x"]), combine=combine)
        whole = model(batch.unwrap()["x"])
    return {
        "error": _relative_error(out, whole),
        "ooms": step.controller.oom_count,
        "count": step.controller.split_count,
    }


@pytest.mark.parametrize("kind", KINDS)
def test_evaluate_retries_an_oom_in_the_cut_or_in_combine_on_one_rank(ranks: RankPool, kind: str) -> None:
    results = ranks.run(_evaluate_through_ooms, kind, timeout=60)
    for result in results:
        assert result["ooms"] == 2 and result["count"] == 12  # rank 1's cut (3 -> 6), then rank 0's combine
        assert result["error"] <= RTOL


def _limit_reached(rank: int, world: int, kind: str, stage: str) -> dict[str, Any]:
    """Rank 0 (12 rows) reaches max_split_count=4 at microbatch size 3 while rank 1 (7 rows) would go on."""
    model = _distribute(kind, _plain_model())
    # FSDP2 gathered once an attempt: gather="auto" would switch to per-module gathering at the limit instead
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3, max_split_count=4), gather="attempt")
    with inject_oom(_inner(model), phase="forward", calls=[0, 3], rank=0):
        return _final_oom(step, model, _batch(0, rank, [12, 7][rank]), stage)


@pytest.mark.parametrize("stage", ["backward", "evaluate"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_limit_reached_on_one_rank_stops_every_rank(ranks: RankPool, kind: str, stage: str) -> None:
    results = ranks.run(_limit_reached, kind, stage, timeout=60)
    assert results[0]["raised"] is not None and "even at microbatch size" in results[0]["raised"]
    assert results[1]["raised"] is not None and "rank(s) [0] ran out of memory" in results[1]["raised"]


def _limit_in_budgets(rank: int, world: int) -> dict[str, Any]:
    """Both ranks in a MemoryBudget; rank 1's cannot hold the gradients, rank 0's has no limit."""
    from elastic_batches.testing import MemoryBudget

    model = _distribute("ddp", _plain_model())
    batch = _batch(0, rank, 8)
    with MemoryBudget(None if rank == 0 else 256):
        return _final_oom(eb.ElasticStep(model), model, batch, "backward")


def test_only_the_rank_that_ran_out_names_its_memory(ranks: RankPool) -> None:
    results = ranks.run(_limit_in_budgets, timeout=60)
    assert all("even at microbatch size 1" in str(result["raised"]) for result in results)
    assert re.search(r"MemoryBudget: \d+ bytes of 256 bytes were in use before the step began", results[1]["raised"])
    assert "in use before the step" not in results[0]["raised"]  # rank 0 stopped for rank 1's OOM, not its own


def _parameters_do_not_fit(rank: int, world: int, stage: str) -> dict[str, Any]:
    """FSDP2 gathered once an attempt: rank 1 cannot hold the unsharded parameters, which every microbatch needs."""
    model = _distribute("fsdp", _plain_model())
    step = eb.ElasticStep(model, controller=eb.SplitController(), gather="attempt")
    batch = _batch(0, rank, 8)
    # the sync's own buffers fit (the guard's: 144 bytes), the parameters' 1.6 KB do not
    with MemoryBudget(512 if rank == 1 else 1 << 30):
        return _final_oom(step, model, batch, stage)


@pytest.mark.parametrize("stage", ["backward", "evaluate"])
def test_fsdp2_parameters_that_do_not_fit_on_one_rank_raise_on_every_rank(ranks: RankPool, stage: str) -> None:
    """Unsharding is checked before any rank starts to all-gather: no rank is left waiting in it."""
    for result in ranks.run(_parameters_do_not_fit, stage, timeout=60):
        assert result["raised"] is not None and "rank(s) [1] cannot hold the model's gathered" in result["raised"]
        assert result["retries"] == 0  # splitting cannot help: nothing was retried


# -- parameters some rank, or every rank, leaves without gradient ------------------------------


class _Branches(nn.Module):
    """``shared`` is used on every row, ``first`` on rank 0's rows only, ``never`` on none."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared, self.first, self.never = nn.Linear(6, 1), nn.Linear(6, 1), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, use_first: bool, use_never: bool = False) -> torch.Tensor:
        y = self.shared(x) + self.first(x) if use_first else self.shared(x)
        return y + self.never(x) if use_never else y


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5)  # moves zero gradients, skips None


def _branches(rank: int, world: int, kind: str, oom: bool = False) -> dict[str, Any]:
    """Three steps at split 2, AdamW; and the same on one process over both ranks' batches (each rank computes it).

    With ``oom``, rank 1 runs out of memory in a forward of the second step (a fused vote under DDP).
    """
    model: nn.Module = _Branches()
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)  # without find_unused_parameters, which it does not need
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (model.shared, model.first, model.never):
            fully_shard(layer, mesh=_mesh())
        model = fully_shard(model, mesh=_mesh())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    optimizer = _adamw(model)
    reference = _Branches()
    reference_optimizer = _adamw(reference)
    injected = inject_oom(_inner(model).shared, phase="forward", calls=3, rank=1) if oom else None
    for i in range(3):
        x, y = _batch(i, rank, 8)
        optimizer.zero_grad()
        step.backward((x, y), lambda mb: nn.functional.mse_loss(model(mb[0], rank == 0), mb[1]))
        optimizer.step()
        reference_optimizer.zero_grad()
        batches = [_batch(i, r, 8) for r in range(world)]
        outputs = torch.cat([reference(xr, r == 0) for r, (xr, _) in enumerate(batches)])
        nn.functional.mse_loss(outputs, torch.cat([yr for _, yr in batches])).backward()
        reference_optimizer.step()
    if injected is not None:
        injected.remove()
    never = _inner(model).never
    grads = [p.grad for p in never.parameters()]
    return {
        "fired": 0 if injected is None else injected.fired,
        "error": _relative_error(_full(model.parameters()), _full(reference.parameters())),
        "never_grads": [g is None for g in grads],
        "never_unchanged": torch.equal(_full(never.parameters()), _full(_Branches().never.parameters())),
    }


@pytest.mark.parametrize("oom", [False, True], ids=["fits", "oom-on-rank-1"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_parameter_no_rank_uses_keeps_no_gradient_as_on_one_process(ranks: RankPool, kind: str, oom: bool) -> None:
    """Zero gradients would let AdamW's weight decay move it; the one-process run leaves it where it is."""
    results = ranks.run(_branches, kind, oom, timeout=60)
    assert [r["fired"] for r in results] == [0, 1 if oom else 0]
    for result in results:
        assert result["error"] <= RTOL  # the branch only rank 0 uses is averaged over both ranks' rows
        assert result["never_grads"] == [True, True] and result["never_unchanged"]


def _unused_collectives(rank: int, world: int) -> list[dict[str, int]]:
    """DDP steps where some rank leaves a parameter unused, then one where every rank uses every parameter."""
    model = nn.parallel.DistributedDataParallel(_Branches())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    per_step = []
    for i, use_all in enumerate([False, False, True]):
        x, y = _batch(i, rank, 8)
        use_first = rank == 0 or use_all

        def loss_fn(mb: tuple[torch.Tensor, torch.Tensor], use_first: bool = use_first, use_all: bool = use_all) -> Any:
            return nn.functional.mse_loss(model(mb[0], use_first, use_all), mb[1])

        model.zero_grad(set_to_none=True)
        with _counting_collectives() as counts:
            step.backward((x, y), loss_fn)
        per_step.append(counts)
    return per_step


def test_ddp_an_unused_parameter_costs_one_all_reduce_only_in_the_steps_that_leave_one(ranks: RankPool) -> None:
    for first, fused, all_used in ranks.run(_unused_collectives, timeout=60):
        assert first == {"all_reduce": 1 + 1, GATHER: 1, "all_gather": 0, "broadcast": 0, SCATTER: 0}  # + unused map
        assert fused == {"all_reduce": 1 + 1, GATHER: 0, "all_gather": 0, "broadcast": 0, SCATTER: 0}  # vote in it
        assert all_used == {"all_reduce": 1, GATHER: 0, "all_gather": 0, "broadcast": 0, SCATTER: 0}


# -- what ElasticStep does not support: a clear error on every rank, no hang -----------------------


def _unsupported_ddp(rank: int, world: int, case: str) -> str:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    inner = _plain_model()
    if case == "sparse":
        inner = nn.Sequential(nn.EmbeddingBag(10, 6, sparse=True), *inner)
    model = nn.parallel.DistributedDataParallel(inner, static_graph=case == "static_graph")
    if case == "comm_hook":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    batch = (torch.randint(10, (8, 3)), torch.randn(8, 1)) if case == "sparse" else _batch(0, rank, 8)
    with pytest.raises(NotImplementedError) as raised:
        step.backward(batch, _loss_fn(model))
    dist.barrier()  # every rank got here: none waits in a collective
    return str(raised.value)


def _unsupported_fsdp(rank: int, world: int, case: str) -> str:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    model: nn.Module = _plain_model()
    if case == "root_not_sharded":
        fully_shard(model[0], mesh=_mesh())  # a layer, not the root
    else:
        model = fully_shard(model, mesh=_mesh(), shard_placement_fn=lambda p: Shard(p.dim() - 1))
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2), gather="attempt")
    with pytest.raises(NotImplementedError) as raised:
        step.backward(_batch(0, rank, 8), _loss_fn(model))
    dist.barrier()
    return str(raised.value)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "shard_placement",
            r"once an attempt supports FSDP2 with Shard\(0\) parameters.*got placements \(Shard\(dim=1\),\)",
        ),
        ("root_not_sharded", r"Sequential holds FSDP2 modules but is not one itself: apply fully_shard to the root"),
    ],
)
def test_fsdp_layouts_elastic_step_cannot_handle_raise_on_every_rank(ranks: RankPool, case: str, message: str) -> None:
    for error in ranks.run(_unsupported_fsdp, case, timeout=60):
        assert re.search(message, error), error


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("static_graph", r"does not support DistributedDataParallel\(static_graph=True\).*without static_graph"),
        ("comm_hook", r"would skip the DDP communication hook\(s\) \['fp16_compress_hook'\].*without them"),
        ("sparse", r"reduces dense gradients only; module\(s\) \['0'\] make sparse ones.*sparse=False"),
    ],
)
def test_ddp_options_elastic_step_cannot_honour_raise_on_every_rank(ranks: RankPool, case: str, message: str) -> None:
    for error in ranks.run(_unsupported_ddp, case, timeout=60):
        assert re.search(message, error), error


# -- BatchNorm with DDP's buffer broadcast ------------------------------------------------------


_IGNORED = ["0.weight", "2.running_mean"]  # a parameter and a buffer, by their names in the module


def _batch_norm(rank: int, world: int, plan: list[Any], ignore: bool = False) -> dict[str, Any]:
    """ElasticStep against plain DDP with a hand-written accumulation at the same split (buffers broadcast).

    With ``ignore``, DDP is told to leave one parameter and one buffer out of its synchronisation.
    """
    modules = [_plain_model(batch_norm=True) for _ in range(2)]
    if ignore:
        for module in modules:
            nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, _IGNORED)
    elastic, plain = (_distribute("ddp", module) for module in modules)  # DDP broadcasts buffers by default
    controller = eb.SplitController(split_count=2)
    step = eb.ElasticStep(elastic, controller=controller)
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in (elastic, plain)]
    handles = _injections(elastic, plan)
    for i in range(3):
        x, y = _batch(i, rank, 12)
        for optimizer in optimizers:
            optimizer.zero_grad()
        step.backward((x, y), _loss_fn(elastic))
        count = controller.split_count
        pieces = list(zip(x.tensor_split(count), y.tensor_split(count), strict=True))
        for j, (xj, yj) in enumerate(pieces):
            context = plain.no_sync() if j < count - 1 else torch.enable_grad()
            with context:
                (_loss_fn(plain)((xj, yj)) * (len(xj) / len(x))).backward()
        for optimizer in optimizers:
            optimizer.step()
    for h in handles:
        h.remove()
    weights = [torch.cat([p.detach().reshape(-1) for p in m.module.parameters()]) for m in (elastic, plain)]
    buffers = [torch.cat([b.double().reshape(-1) for b in m.module.buffers()]) for m in (elastic, plain)]
    gathered = [torch.empty_like(buffers[0]) for _ in range(world)]
    dist.all_gather(gathered, buffers[0])
    ignored = dict(elastic.module.named_parameters())["0.weight"].detach().clone()
    ignored_everywhere = [torch.empty_like(ignored) for _ in range(world)]
    dist.all_gather(ignored_everywhere, ignored)
    means = [dict(m.module.named_buffers())["2.running_mean"] for m in (elastic, plain)]
    return {
        "weight_error": _relative_error(weights[0], weights[1]),
        "buffer_error": _relative_error(buffers[0], buffers[1]),
        "running_mean_error": _relative_error(means[0], means[1]),
        "buffers_agree": all(torch.equal(g, gathered[0]) for g in gathered),
        "ignored_parameter_agrees": torch.equal(ignored_everywhere[0], ignored_everywhere[1]),
        "count": controller.split_count,
    }


def test_batch_norm_with_broadcast_buffers_matches_plain_ddp(ranks: RankPool) -> None:
    results = ranks.run(_batch_norm, [], timeout=60)
    assert all(r["buffers_agree"] and r["ignored_parameter_agrees"] for r in results)
    assert results[0]["buffer_error"] <= RTOL, "rank 0's buffers (the ones DDP broadcasts) differ from plain DDP's"
    for result in results:
        assert result["weight_error"] <= RTOL


def test_what_ddp_is_told_to_ignore_stays_local_as_in_plain_ddp(ranks: RankPool) -> None:
    """A parameter and a buffer left out of DDP's sync: each rank's own, equal to plain DDP's on that rank."""
    results = ranks.run(_batch_norm, [], True, timeout=60)
    for result in results:
        assert result["weight_error"] <= RTOL and result["running_mean_error"] <= RTOL
        assert not result["buffers_agree"] and not result["ignored_parameter_agrees"]
    assert results[0]["buffer_error"] <= RTOL


@pytest.mark.parametrize("rank", [0, 1], ids=["rank0", "rank1"])
@pytest.mark.parametrize("call", [1, 3], ids=["first-step", "second-step-last-microbatch"])
def test_batch_norm_with_an_oom_on_one_rank(ranks: RankPool, call: int, rank: int) -> None:
    """The failed attempt's forwards updated the running statistics of the rank that finished it: rolled back."""
    results = ranks.run(_batch_norm, [("forward", "model", [call], rank)], timeout=60)
    assert results[0]["count"] == results[1]["count"] > 2
    assert all(r["buffers_agree"] for r in results)
    for result in results:
        assert result["weight_error"] <= RTOL
    # rank 0's buffers, the ones DDP broadcasts, are those of plain DDP at the split the step ran at
    assert results[0]["buffer_error"] <= RTOL, "the failed attempt's running statistics survived"


def _dropout_step(rank: int, world: int, kind: str, split: int, oom_rank: int | None) -> torch.Tensor:
    """One SGD step of a model with dropout at ``split`` microbatches (an OOM on ``oom_rank`` first)."""
    model = _distribute(kind, nn.Sequential(_plain_model(), nn.Dropout(0.5)))
    controller = eb.SplitController(split_count=split)
    step = eb.ElasticStep(model, controller=controller)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    torch.manual_seed(100 + rank)  # each rank draws its own dropout masks
    calls = [1] if oom_rank is not None else [10**6]
    with inject_oom(_inner(model), phase="forward", calls=calls, rank=oom_rank):
        step.backward(_batch(0, rank, 12), _loss_fn(model))
    optimizer.step()
    assert controller.split_count == 6
    return _full(model.parameters())


def _dropout_retry(rank: int, world: int, kind: str) -> dict[str, Any]:
    retried = _dropout_step(rank, world, kind, 3, oom_rank=1)
    direct = _dropout_step(rank, world, kind, 6, oom_rank=None)
    return {"error": _relative_error(retried, direct)}


@pytest.mark.parametrize("kind", KINDS)
def test_dropout_in_a_retry_draws_what_a_step_at_its_split_draws(ranks: RankPool, kind: str) -> None:
    """An OOM on rank 1 at 3 microbatches, retried at 6: the same update as a step run at 6, masks included."""
    results = ranks.run(_dropout_retry, kind, timeout=60)
    for rank, result in enumerate(results):
        assert result["error"] <= 1e-7, f"rank {rank}: {result['error']:.2e}"


# -- the optimizer step -------------------------------------------------------------------------


def _optimizer_oom(rank: int, world: int, kind: str, max_grad_norm: float | None) -> dict[str, Any]:
    model = _distribute(kind, _plain_model())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    outcome: dict[str, Any] = {}
    with inject_oom_in_optimizer(optimizer, calls=1, rank=0):
        for i in range(2):
            optimizer.zero_grad()
            step.backward(_batch(i, rank, 8), _loss_fn(model))
            try:
                step.optimizer_step(optimizer, max_grad_norm=max_grad_norm)
            except torch.OutOfMemoryError as err:
                outcome = {"step": i, "type": type(err).__name__, "message": str(err)}
                break
    return outcome


@pytest.mark.parametrize("max_grad_norm", [None, 0.01], ids=["step", "clip-and-step"])
@pytest.mark.parametrize("kind", KINDS)
def test_oom_in_optimizer_step_raises_on_every_rank(ranks: RankPool, kind: str, max_grad_norm: float | None) -> None:
    results = ranks.run(_optimizer_oom, kind, max_grad_norm, timeout=60)
    for result in results:
        assert result["step"] == 1
        assert result["type"] == "ElasticOOMError"
        assert "out of memory in optimizer.step() on rank(s) [0]" in result["message"]


def _clipped(rank: int, world: int, kind: str) -> dict[str, Any]:
    rows = [12, 7]
    model = _distribute(kind, _plain_model())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    reference = _plain_model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    norms = []
    for i in range(2):
        optimizer.zero_grad()
        step.backward(_batch(i, rank, rows[rank]), _loss_fn(model))
        norm = step.optimizer_step(optimizer, max_grad_norm=0.05)
        x, y = _union_batch(i, rows)
        reference_optimizer.zero_grad()
        _loss_fn(reference)((x, y)).backward()
        reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        reference_optimizer.step()
        assert norm is not None
        norms.append(abs(float(norm) / float(reference_norm) - 1))
    error = _relative_error(_full(model.parameters()), _full(reference.parameters()))
    return {"norm_error": max(norms), "error": error}


@pytest.mark.parametrize("kind", KINDS)
def test_clipping_matches_clip_grad_norm_on_the_full_batch(ranks: RankPool, kind: str) -> None:
    for result in ranks.run(_clipped, kind, timeout=60):
        assert result["norm_error"] <= RTOL
        assert result["error"] <= RTOL


def _inf_on_one_rank(rank: int, world: int, kind: str) -> dict[str, Any]:
    model = _distribute(kind, _plain_model())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2), grad_scaler=scaler)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    before = _full(model.parameters()).clone()
    x, y = _batch(0, rank, 8)
    if rank == 1 and kind == "ddp":
        x[0, 0] = float("inf")  # rank 1's backward overflows; the all-reduce carries it to every rank
    step.backward((x, y), _loss_fn(model))
    if rank == 1 and kind == "fsdp":  # an overflow that lands in rank 1's shard of the gradient only
        grad = next(p.grad for p in model.parameters() if p.grad is not None)
        grad.to_local().view(-1)[0] = float("inf")
    step.optimizer_step(optimizer)
    skipped = bool(torch.equal(_full(model.parameters()), before))
    optimizer.zero_grad()
    step.backward(_batch(1, rank, 8), _loss_fn(model))
    step.optimizer_step(optimizer)
    stepped = not torch.equal(_full(model.parameters()), before)
    return {"skipped": skipped, "scale": scaler.get_scale(), "stepped": stepped}


@pytest.mark.parametrize("kind", KINDS)
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(ranks: RankPool, kind: str) -> None:
    """GradScaler: an inf in one rank's backward (DDP) or gradient shard (FSDP2) skips the step everywhere.

    Both ranks then halve the scale, and the next step goes through on both.
    """
    for result in ranks.run(_inf_on_one_rank, kind, timeout=60):
        assert result == {"skipped": True, "scale": 512.0, "stepped": True}


# -- errors that are not OOMs -------------------------------------------------------------------


def _error_on_one_rank(rank: int, world: int, kind: str, warm_up: bool) -> dict[str, Any]:
    model = _distribute(kind, _plain_model())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    loss_fn = _loss_fn(model)
    if warm_up:  # under DDP, the votes after a first step ride in the first bucket
        step.backward(_batch(2, rank, 12), loss_fn)
        model.zero_grad(set_to_none=True)
    calls = [0]

    def failing(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls[0] += 1
        if rank == 1 and calls[0] == 2:
            raise KeyError("bad sample on rank 1")
        return loss_fn(mb)

    outcome: dict[str, Any] = {}
    try:
        step.backward(_batch(0, rank, 12), failing)
    except Exception as err:  # every rank must get here
        outcome = {"type": type(err).__name__, "message": str(err)}
    grads_clean = all(p.grad is None for p in model.parameters())
    step.backward(_batch(1, rank, 12), loss_fn)  # the ranks still work together afterwards
    error = _relative_error(_full(p.grad for p in model.parameters()), _reference_grads([12, 12], 1))
    return {**outcome, "grads_clean": grads_clean, "error": error}


def _reference_grads(rows: list[int], step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    model = _plain_model().to(dtype)
    x, y = (t.to(dtype) for t in _union_batch(step, rows))
    _loss_fn(model)((x, y)).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("warm_up", [False, True], ids=["first-step", "second-step"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_error_on_one_rank_raises_on_every_rank(ranks: RankPool, kind: str, warm_up: bool) -> None:
    results = ranks.run(_error_on_one_rank, kind, warm_up, timeout=60)
    assert results[1]["type"] == "KeyError" and "bad sample on rank 1" in results[1]["message"]
    assert results[0]["type"] == "RuntimeError" and "rank(s) [1] raised an error" in results[0]["message"]
    for result in results:
        assert result["grads_clean"]
        assert result["error"] <= RTOL


# -- the controller's state --------------------------------------------------------------------


def _resume(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Rank 1 has less simulated memory: a fresh run OOMs there; a run restored from its state does not."""
    rows = 256  # activations, not parameters, dominate: 256 rows x 64 wide against ~5k parameters

    def peak(split_count: int) -> int:
        model = _distribute(kind, _plain_model(width=64))
        step = eb.ElasticStep(model, controller=eb.SplitController(split_count=split_count))
        budget = MemoryBudget(None)
        with budget:
            step.backward(_batch(0, rank, rows), _loss_fn(model))
        return budget.peak_bytes

    middle = (peak(1) + peak(2)) // 2  # every rank builds the models alike: their constructors communicate
    limit = middle if rank == 1 else None  # one batch at once does not fit on rank 1; halves do

    def run(state: dict[str, Any] | None) -> tuple[eb.SplitController, int]:
        model = _distribute(kind, _plain_model(width=64))
        controller = eb.SplitController()
        if state is not None:
            controller.load_state_dict(state)
        step = eb.ElasticStep(model, controller=controller, memory=None)  # the OOM-driven search's state resumed
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        budget = MemoryBudget(limit)
        for i in range(3):
            optimizer.zero_grad(set_to_none=True)
            with budget:
                step.backward(_batch(i, rank, rows), _loss_fn(model))
            optimizer.step()
        return controller, budget.oom_count

    first, first_ooms = run(None)
    second, second_ooms = run(first.state_dict())
    return {
        "first_ooms": first_ooms,
        "state": first.state_dict(),
        "second_ooms": second_ooms,
        "counts": (first.split_count, second.split_count),
        "oom_count": (first.oom_count, second.oom_count),
    }


@pytest.mark.parametrize("kind", KINDS)
def test_controller_state_is_the_same_on_every_rank_and_resumes_without_oom(ranks: RankPool, kind: str) -> None:
    results = ranks.run(_resume, kind, timeout=60)
    assert [r["first_ooms"] for r in results] == [0, 1]
    assert _learned(results[0]["state"]) == _learned(results[1]["state"])
    assert results[0]["counts"] == results[1]["counts"] == (2, 2)
    for result in results:
        assert result["second_ooms"] == 0
        assert result["oom_count"] == (1, 1), "the restored controller reported no new OOM"


# -- predicted microbatches: each rank's capacity in the vote --------------------------------------


def _predicted(
    rank: int, world: int, kind: str, gather: str, oom_at: int | None = None, probed: tuple[int, ...] = (0, 1)
) -> dict[str, Any]:
    """Each rank measures with its own budget, rank 1's tighter; every step after the first runs one agreed plan.

    ``oom_at``: the forward call (from 0) in which rank 1 runs out of memory besides, an OOM the
    model did not predict. ``probed``: the ranks whose step measures memory (the others' do not).
    """
    rows, steps = 256, 4

    def peak(split_count: int) -> int:
        model = _distribute(kind, _plain_model(width=64))
        step = eb.ElasticStep(
            model, controller=eb.SplitController(split_count, margin=None), memory=None, gather=gather
        )
        budget = MemoryBudget(None)
        with budget:
            step.backward(_batch(0, rank, rows), _loss_fn(model))
        return budget.peak_bytes

    peaks = {count: peak(count) for count in (2, 5)}  # every rank builds the models alike
    budget = MemoryBudget(peaks[5 if rank == 1 else 2] + 64)
    model = _distribute(kind, _plain_model(width=64))
    controller = eb.SplitController()
    step = eb.ElasticStep(model, controller=controller, memory=budget if rank in probed else None, gather=gather)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with contextlib.ExitStack() as stack:
        if oom_at is not None:
            first = (model.module if kind == "ddp" else model)[0]
            stack.enter_context(inject_oom(first, phase="forward", calls=oom_at, rank=1))
        plans, failed = [], []
        for i in range(steps):
            seen: list[int] = []
            before = controller.oom_count

            def loss_fn(mb: eb.Microbatch, seen: list[int] = seen) -> torch.Tensor:
                if mb.index == 0:
                    seen.clear()
                seen.append(len(mb))
                return _loss_fn(model)(mb.unwrap())

            optimizer.zero_grad(set_to_none=True)
            with budget:
                step.backward(_batch(i, rank, rows), loss_fn, unwrap=False)
            optimizer.step()
            plans.append(list(seen))
            failed.append(controller.oom_count - before)  # attempts that failed on some rank
    return {
        "plans": plans,
        "ooms": budget.oom_count + controller.oom_count,
        "failed": failed,
        "predicting": controller.predicting(),
        "weights": _full(model.parameters()),
    }


def _predicted_reference() -> torch.Tensor:
    """The weights of ``_predicted``'s steps as full-batch SGD over both ranks' rows."""
    reference = _plain_model(width=64)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for i in range(4):
        optimizer.zero_grad()
        _loss_fn(reference)(_union_batch(i, [256, 256])).backward()
        optimizer.step()
    return _full(p for p in reference.parameters())


@pytest.mark.parametrize(("kind", "gather"), [("ddp", "auto"), ("fsdp", "auto"), ("fsdp", "module")])
def test_ranks_with_unequal_memory_agree_on_one_predicted_plan_without_an_oom(
    ranks: RankPool, kind: str, gather: str
) -> None:
    results = ranks.run(_predicted, kind, gather, timeout=60)
    want = _predicted_reference()
    for result in results:
        assert result["predicting"]
        assert _relative_error(result["weights"], want) <= RTOL
        assert result["ooms"] == 0
        assert result["plans"][0][0] == 1  # the first batch: a measuring microbatch, then cut as predicted
        if gather == "module":  # collectives pair the microbatches: every rank cuts as many, each agreed
            assert [len(plan) for plan in result["plans"]] == [len(plan) for plan in results[0]["plans"]]
    # The first vote forecast from memory before DDP's buckets existed; a rank that sees less free memory at the
    # next step plans for it. From the second vote on, one plan: the smallest capacity in the vote, rank 1's.
    assert results[0]["plans"][2:] == results[1]["plans"][2:]
    assert all(len(plan) >= 5 for result in results for plan in result["plans"][1:])  # rank 1 needs 5 or more


@pytest.mark.filterwarnings("ignore:elastic_batches. ElasticStep. some rank has no memory prediction")
@pytest.mark.parametrize(("kind", "gather"), [("ddp", "auto"), ("fsdp", "module")])
def test_ranks_with_and_without_a_probe_plan_alike_from_the_first_vote(ranks: RankPool, kind: str, gather: str) -> None:
    """Rank 0 predicts, rank 1 has no probe: after the first vote both plan from the search, one plan."""
    results = ranks.run(_predicted, kind, gather, None, (0,), timeout=90)
    want = _predicted_reference()
    for result in results:
        assert _relative_error(result["weights"], want) <= RTOL
    assert results[0]["plans"][1:] == results[1]["plans"][1:]  # rank 0 ran the model's plan alone before
    assert all(len(set(plan)) <= 2 for plan in results[0]["plans"][1:])  # balanced: the search's cut


@pytest.mark.parametrize(("kind", "gather"), [("ddp", "auto"), ("fsdp", "module")])
@pytest.mark.parametrize("oom_at", [2, 4])
def test_an_oom_on_one_rank_while_measuring_is_retried_by_every_rank(
    ranks: RankPool, kind: str, gather: str, oom_at: int
) -> None:
    """Rank 1 fails in an early or a late microbatch of the measuring attempt: no hang, exact weights."""
    results = ranks.run(_predicted, kind, gather, oom_at, timeout=60)
    want = _predicted_reference()
    for result in results:
        assert _relative_error(result["weights"], want) <= RTOL
        assert result["failed"][0] >= 1 and result["failed"][1:] == [0, 0, 0]  # every rank retried the batch
        if gather == "module":  # collectives pair the microbatches: every rank cut as many, each agreed
            assert [len(plan) for plan in result["plans"]] == [len(plan) for plan in results[0]["plans"]]


# -- FSDP2 with mixed precision, and forward-only stages ------------------------------------------


def _mixed_precision(rank: int, world: int, reduce_dtype: torch.dtype) -> tuple[float, int]:
    """bf16 parameters, fp32 or bf16 reduction; the gradients' error and the step's reduce-scatters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    model = _distribute("fsdp", _plain_model(), mp_policy=policy)
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    with inject_oom(model, phase="forward", calls=1, rank=1), _counting_collectives() as counts:
        step.backward(_batch(0, rank, 12), lambda mb: nn.functional.mse_loss(model(mb[0]).float(), mb[1]))
    error = _relative_error(_full(p.grad.float() for p in model.parameters()), _reference_grads([12, 12], 0))
    return error, counts[SCATTER]


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16], ids=["fp32-reduce", "bf16-reduce"])
def test_fsdp2_mixed_precision_with_an_oom(ranks: RankPool, reduce_dtype: torch.dtype) -> None:
    """The accumulated gradients, in fp32 (FSDP2's buffer) or bf16, ride with the vote, summed in fp32."""
    results = ranks.run(_mixed_precision, reduce_dtype, timeout=60)
    errors = [error for error, _ in results]  # about 2e-3 with either reduction
    assert all(error <= 1e-2 for error in errors), f"bf16 forward: relative gradient errors {errors}"
    assert [count for _, count in results] == [2, 2]  # the failed attempt's vote, then the retry's (all in it)


def _float64(rank: int, world: int) -> tuple[float, int]:
    """float64 parameters and an OOM on rank 1; the gradients' error and the step's reduce-scatters."""
    model = _distribute("fsdp", _plain_model().double())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    x, y = (t.double() for t in _batch(0, rank, 12))
    with inject_oom(model, phase="forward", calls=1, rank=1), _counting_collectives() as counts:
        step.backward((x, y), _loss_fn(model))
    error = _relative_error(_full(p.grad for p in model.parameters()), _reference_grads([12, 12], 0, torch.float64))
    return error, counts[SCATTER]


def test_fsdp2_float64_gradients_ride_with_the_vote_in_float64(ranks: RankPool) -> None:
    results = ranks.run(_float64, timeout=60)
    errors = [error for error, _ in results]
    assert all(error <= 1e-12 for error in errors), f"relative gradient errors {errors} (float32 would give ~1e-8)"
    assert [count for _, count in results] == [2, 2]  # the failed attempt's vote, then the retry's (all in it)


def _evaluate(rank: int, world: int, kind: str) -> dict[str, Any]:
    model = _distribute(kind, _plain_model())
    controller = eb.SplitController(split_count=2)
    step = eb.ElasticStep(model, controller=controller)
    x, _ = _batch(0, rank, 12)
    with torch.no_grad(), inject_oom(_inner(model), phase="forward", calls=1, rank=1):
        outputs = step.evaluate(x, model)
    reference = _plain_model()(x).detach()
    return {"error": _relative_error(torch.cat(outputs), reference), "count": controller.split_count}


@pytest.mark.parametrize("kind", KINDS)
def test_evaluate_with_an_oom_on_one_rank(ranks: RankPool, kind: str) -> None:
    results = ranks.run(_evaluate, kind, timeout=60)
    assert results[0]["count"] == results[1]["count"] > 2
    assert all(r["error"] <= RTOL for r in results)


# -- DDP: the vote inside the first bucket's all-reduce ---------------------------------------------

GATHER = distributed.wire.ALL_GATHER  # the vote's all-gather
SCATTER = distributed.wire.REDUCE_SCATTER  # FSDP2's gradient reduce-scatter
_COUNTED = ("all_reduce", GATHER, "all_gather", "broadcast", SCATTER)


@contextlib.contextmanager
def _counting_collectives() -> Iterator[dict[str, int]]:
    """Count the calls of ``torch.distributed``'s collectives (the library looks them up at each call)."""
    counts = dict.fromkeys(_COUNTED, 0)
    originals = {name: getattr(dist, name) for name in _COUNTED}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in _COUNTED:
        setattr(dist, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _counted_steps(
    rank: int, kind: str, plan: list[Any], rows: list[int], **sync_options: Any
) -> tuple[nn.Module, eb.ElasticStep, list[dict[str, int]], list[int]]:
    """3 steps of split 3 with the OOMs of ``plan``; the model, the step, each step's collectives, the OOMs fired.

    ``sync_options`` go to ``gradient_sync_for`` (smaller buckets, so that tensors are cut between several).
    """
    model = _distribute(kind, _plain_model())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    step.sync = distributed.gradient_sync_for(model, **sync_options)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    handles = _injections(model, plan)
    per_step = []
    for i in range(3):
        optimizer.zero_grad(set_to_none=True)
        with _counting_collectives() as counts:
            step.backward(_batch(i, rank, rows[rank]), _loss_fn(model))
        optimizer.step()
        per_step.append(counts)
    fired = [h.fired for h in handles]
    for h in handles:
        h.remove()
    return model, step, per_step, fired


def _fused(rank: int, world: int, plan: list[Any], rows: list[int], bucket_bytes: int | None = None) -> dict[str, Any]:
    """3 DDP steps of split 3; the collectives each step started, the weights' error and the controller."""
    options = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    model, step, per_step, fired = _counted_steps(rank, "ddp", plan, rows, **options)
    assert isinstance(step.sync, distributed.ddp.DistributedDataParallel)
    sync_plan = step.sync._plan
    assert sync_plan is not None
    return {
        "error": _relative_error(_full(model.parameters()), _reference(rows, 3)),
        "per_step": per_step,
        "buckets": len(sync_plan.buckets),
        "fired": fired,
        "counts": [step.controller.split_count],
        "state": step.controller.state_dict(),
    }


@pytest.mark.parametrize("bucket_bytes", [None, 512], ids=["one-bucket", "four-buckets"])
def test_ddp_fuses_the_vote_into_the_first_bucket_from_the_second_step(
    ranks: RankPool, bucket_bytes: int | None
) -> None:
    results = ranks.run(_fused, [], [12, 7], bucket_bytes, timeout=60)
    for result in results:
        assert result["error"] <= RTOL
        buckets = result["buckets"]
        assert buckets == (1 if bucket_bytes is None else 4)  # 401 float32 gradients, 128 to a bucket of 512 bytes
        first, *steady = result["per_step"]
        assert first == {"all_reduce": buckets, GATHER: 1, "all_gather": 0, "broadcast": 0, SCATTER: 0}
        for counts in steady:  # the vote rides in the first bucket: no collective of its own
            assert counts == {"all_reduce": buckets, GATHER: 0, "all_gather": 0, "broadcast": 0, SCATTER: 0}


FUSED_OOM_PLANS = {
    # step 1 (the first fused one) runs forward calls 3, 4, 5
    "forward-last-rank1": [("forward", "model", [5], 1)],
    "backward-last-rank0": [("backward", "first", [5], 0)],
    "backward-first-rank1": [("backward", "first", [3], 1)],
    "both-ranks-same-attempt": [("forward", "model", [4], 0), ("backward", "first", [5], 1)],
}


@pytest.mark.parametrize("bucket_bytes", [None, 512], ids=["one-bucket", "four-buckets"])
@pytest.mark.parametrize("plan", list(FUSED_OOM_PLANS.values()), ids=list(FUSED_OOM_PLANS))
def test_ddp_a_rank_that_failed_joins_the_fused_all_reduce(
    ranks: RankPool, plan: list[Any], bucket_bytes: int | None
) -> None:
    results = ranks.run(_fused, plan, [12, 12], bucket_bytes, timeout=60)
    assert [sum(r["fired"]) for r in results] == [sum(1 for p in plan if p[3] == rank) for rank in range(2)]
    assert results[0]["counts"] == results[1]["counts"] and results[0]["counts"][0] > 3
    assert _learned(results[0]["state"]) == _learned(results[1]["state"])
    for result in results:
        assert result["error"] <= RTOL
        failed = result["per_step"][1]
        # two fused attempts, each every bucket (a failed rank stands in for those it did not start), and one
        # small collective after the OOM
        assert failed[GATHER] == 1
        assert failed["all_reduce"] == 2 * result["buckets"]


def _frozen_then_trained(rank: int, world: int) -> dict[str, Any]:
    """DDP over a model whose first layer is frozen when wrapped, trained from step 2 on; 4 steps of split 3."""
    rows = [12, 7]
    plain = _plain_model()
    plain[0].requires_grad_(False)
    model = _distribute("ddp", plain)
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    reference = _plain_model()
    reference[0].requires_grad_(False)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    grads = []
    for i in range(4):
        if i == 2:
            plain[0].requires_grad_(True)
            reference[0].requires_grad_(True)
        optimizer.zero_grad(set_to_none=True)
        step.backward(_batch(i, rank, rows[rank]), _loss_fn(model))
        grads.append(plain[0].weight.grad is not None)
        optimizer.step()
        x, y = _union_batch(i, rows)
        reference_optimizer.zero_grad(set_to_none=True)
        _loss_fn(reference)((x, y)).backward()
        reference_optimizer.step()
    return {"error": _relative_error(_full(model.parameters()), _full(reference.parameters())), "grads": grads}


def test_ddp_a_layer_frozen_when_wrapped_trains_once_unfrozen_as_in_one_process(ranks: RankPool) -> None:
    """ElasticStep lists the parameters DDP wrapped once, and reads at every step which of them train.

    (DDP's own reduction would leave the unfrozen layer unsynchronised: it hooks what trained when wrapped.)
    """
    for result in ranks.run(_frozen_then_trained, timeout=60):
        assert result["error"] <= RTOL, f"relative weight error {result['error']:.2e}"
        assert result["grads"] == [False, False, True, True]


# -- FSDP2: the vote inside the first reduce-scatter -------------------------------------------------


def _fsdp_fused(rank: int, world: int, plan: list[Any], fused_bytes: int) -> dict[str, Any]:
    """3 FSDP2 steps of split 3 (gradients riding with the vote: at most ``fused_bytes`` a rank); collectives a step."""
    model, step, per_step, fired = _counted_steps(
        rank, "fsdp", plan, [12, 12], fused_bytes=fused_bytes, gather="attempt"
    )
    assert isinstance(step.sync, distributed.fsdp2.FullyShard)
    return {
        "error": _relative_error(_full(model.parameters()), _reference([12, 12], 3)),
        "per_step": per_step,
        "fired": fired,
        "count": step.controller.split_count,
        # FSDP2's own all-gathers in an attempt: one per parameter group
        "unshards": sum(len(distributed.fsdp2.param_groups(module)) for module in step.sync.modules),
    }


# Each rank's part of _plain_model's gradients: 8x6 + 8 + 8x16 + 8 + 1x16 + 1 = 209 float32. All ride
# with the vote, or only what fits in 256 bytes (the first weight and two biases, in order of the
# parameters; the others go in one bucket after the vote).
FSDP_FUSED = {"all-in-the-vote": (1024 * 1024, 1), "some-in-the-vote": (256, 2)}


@pytest.mark.parametrize(("fused_bytes", "scatters"), list(FSDP_FUSED.values()), ids=list(FSDP_FUSED))
def test_fsdp2_runs_one_small_collective_a_step_and_votes_in_the_reduce_scatter(
    ranks: RankPool, fused_bytes: int, scatters: int
) -> None:
    for result in ranks.run(_fsdp_fused, [], fused_bytes, timeout=60):
        assert result["error"] <= RTOL
        # the gather check, then FSDP2's own all-gathers, each after its guard round
        gathers = 1 + 2 * result["unshards"]
        for counts in result["per_step"]:
            assert counts == {"all_reduce": 0, GATHER: gathers, "all_gather": 0, "broadcast": 0, SCATTER: scatters}


@pytest.mark.parametrize(("fused_bytes", "scatters"), list(FSDP_FUSED.values()), ids=list(FSDP_FUSED))
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_fsdp2_a_rank_that_failed_joins_the_vote_in_the_reduce_scatter(
    ranks: RankPool, phase: str, fused_bytes: int, scatters: int
) -> None:
    plan = [(phase, "model" if phase == "forward" else "first", [4], 1)]  # step 1's second microbatch, rank 1
    results = ranks.run(_fsdp_fused, plan, fused_bytes, timeout=60)
    assert [sum(r["fired"]) for r in results] == [0, 1]
    assert results[0]["count"] == results[1]["count"] > 3
    for result in results:
        assert result["error"] <= RTOL
        failed = result["per_step"][1]
        # each attempt: its gather check, FSDP2's all-gathers (each after its guard round) and the vote's
        # reduce-scatter (the failed attempt: that one only); between them, the small collective after an OOM
        assert failed[GATHER] == 2 * (1 + 2 * result["unshards"]) + 1
        assert failed[SCATTER] == 1 + scatters and failed["all_reduce"] == 0


def _library_warnings(rank: int, world: int) -> list[str]:
    """The warnings raised from this library's code during DDP and FSDP2 steps with an OOM on rank 1."""
    oom = [("backward", "first", [4], 1)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fused(rank, world, oom, [12, 12])  # every DDP vote: apart, in the first bucket, after an OOM
        _fsdp_fused(rank, world, oom, 1024 * 1024)  # FSDP2's gather checks and votes in the reduce-scatter
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "elastic_batches" in w.filename]


def test_the_collectives_raise_no_warning(ranks: RankPool) -> None:
    """Every user would see them: deprecated collectives (torch 2.13), a read-only buffer given to torch."""
    assert ranks.run(_library_warnings, timeout=60) == [[], []]


def _first_plan_fails(rank: int, world: int) -> dict[str, Any]:
    """The persistent buffers cannot be allocated on rank 1 at the first attempt: the votes stay separate."""
    original = distributed.ddp.FlatPlan
    calls = [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if rank == 1 and calls[0] == 1:
            raise torch.OutOfMemoryError("simulated: no room for the reduction buffers")
        return original(*args, **kwargs)

    distributed.ddp.FlatPlan = failing  # type: ignore[assignment,misc]
    try:
        return _fused(rank, world, [], [12, 12])
    finally:
        distributed.ddp.FlatPlan = original  # type: ignore[misc]


def test_ddp_an_oom_allocating_the_persistent_buffers_keeps_the_vote_separate(ranks: RankPool) -> None:
    results = ranks.run(_first_plan_fails, timeout=60)
    for result in results:
        assert result["error"] <= RTOL
        first, *steady = result["per_step"]
        # vote (rank 1 not ready), agree after its OOM, vote of the retry (now every rank ready)
        assert first[GATHER] == 3
        assert all(counts[GATHER] == 0 for counts in steady)
    assert results[0]["counts"] == results[1]["counts"] and results[0]["counts"][0] > 3


def _tokens(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of 8 sequences of up to 5 tokens; a different number of counted tokens per rank and step."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 5, 6, generator=generator)
    y = x[..., :1].sin()
    lengths = torch.randint(1, 6, (8,), generator=generator)
    mask = (torch.arange(5) < lengths[:, None]).float()
    return x, y, mask


def _token_loss(model: nn.Module) -> Any:
    def loss_fn(mb: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y, mask = mb
        return ((model(x) - y).squeeze(-1).pow(2) * mask).sum() / mask.sum()

    return loss_fn


def _token_weighted(rank: int, world: int, oom_rank: int | None) -> dict[str, Any]:
    model = _distribute("ddp", _plain_model())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    reference = _plain_model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    tokens = []
    with inject_oom(_inner(model), phase="forward", calls=[5], rank=oom_rank if oom_rank is not None else 99):
        for i in range(3):
            optimizer.zero_grad(set_to_none=True)
            batch = _tokens(i, rank)
            step.backward(batch, _token_loss(model), count_fn=lambda mb: mb[2].sum())
            optimizer.step()
            union = [torch.cat(parts) for parts in zip(*(_tokens(i, r) for r in range(world)), strict=True)]
            reference_optimizer.zero_grad()
            _token_loss(reference)(tuple(union)).backward()
            reference_optimizer.step()
            tokens.append(float(batch[2].sum()))
    return {"error": _relative_error(_full(model.parameters()), _full(reference.parameters())), "tokens": tokens}


@pytest.mark.parametrize("oom_rank", [None, 1], ids=["fits", "oom-on-rank1-in-a-fused-step"])
def test_ddp_fused_vote_is_exact_with_count_fn_weights(ranks: RankPool, oom_rank: int | None) -> None:
    results = ranks.run(_token_weighted, oom_rank, timeout=60)
    totals = [a + b for a, b in zip(results[0]["tokens"], results[1]["tokens"], strict=True)]
    assert len(set(totals)) == 3, "the global token count changes from step to step"
    assert results[0]["tokens"] != results[1]["tokens"]
    for result in results:
        assert result["error"] <= RTOL


def _freeze_later(rank: int, world: int) -> dict[str, Any]:
    """The first layer is frozen on every rank before step 2: its gradients are left out, a new plan is agreed."""
    model = _distribute("ddp", _plain_model())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    reference = _plain_model()
    per_step, errors = [], []
    for i in range(4):
        if i == 2:
            for layer in (_inner(model)[0], reference[0]):
                layer.requires_grad_(False)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        with _counting_collectives() as counts:
            step.backward(_batch(i, rank, 12), _loss_fn(model))
        per_step.append(counts[GATHER])
        x, y = _union_batch(i, [12] * world)
        _loss_fn(reference)((x, y)).backward()
        got = [p.grad for p in model.parameters() if p.grad is not None]
        want = [p.grad for p in reference.parameters() if p.grad is not None]
        errors.append(_relative_error(torch.cat([g.reshape(-1) for g in got]), _full(iter(want))))
    return {"votes": per_step, "error": max(errors), "frozen_grad": _inner(model)[0].weight.grad is None}


def test_ddp_a_changed_set_of_trained_parameters_votes_apart_once(ranks: RankPool) -> None:
    for result in ranks.run(_freeze_later, timeout=60):
        assert result["votes"] == [1, 0, 1, 0]
        assert result["error"] <= RTOL
        assert result["frozen_grad"]


def _vote_in(rank: int, world: int, dtype_name: str) -> dict[str, Any]:
    """A fused vote in a bucket of ``dtype``, with sizes and totals that float32 could not hold."""
    dtype = getattr(torch, dtype_name)
    model = _distribute("ddp", _plain_model().to(dtype))
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    x, y = _batch(0, rank, 8)
    step.backward((x.to(dtype), y.to(dtype)), _loss_fn(model))  # agrees on the persistent buffers
    params = [p for p in model.parameters() if p.requires_grad]
    sync = step.sync
    sync.prepare(params)
    status = eb.distributed.Status.OK if rank == 0 else eb.distributed.Status.OOM
    with _counting_collectives() as counts:
        verdict = sync.vote(eb.distributed.Ballot(status, 2**40 + 3 - rank, 1e15 / 3 + rank, 2**40 + 7 - rank), params)
    sync.discard()
    return {"verdict": tuple(verdict), "counts": counts}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_ddp_fused_vote_is_exact_in_any_gradient_dtype(ranks: RankPool, dtype: str) -> None:
    results = ranks.run(_vote_in, dtype, timeout=60)
    grand_total = math.fsum([1e15 / 3, 1e15 / 3 + 1])
    for rank, result in enumerate(results):
        assert result["counts"][GATHER] == 0 and result["counts"]["all_reduce"] == 1
        status, oom_ranks, error_ranks, oom_size, size, scale, sums, capacity, again = result["verdict"]
        assert (status, oom_ranks, error_ranks, sums, again) == (eb.distributed.Status.OOM, (1,), (), (), False)
        assert (oom_size, size, scale) == (2**40 + 2, 2**40 + 2, (1e15 / 3 + rank) / grand_total)
        assert capacity == 2**40 + 6  # each rank's predicted capacity rides in the vote: the smallest


# -- the harness itself ------------------------------------------------------------------------


def _hang_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        dist.barrier()  # rank 0 never comes


def test_a_hang_fails_with_each_rank_stack(ranks: RankPool) -> None:
    with pytest.raises(RankFailure, match=r"(?s)rank\(s\) \[1\] did not finish _hang_on_rank_1 within 5 s.*barrier"):
        ranks.run(_hang_on_rank_1, timeout=5)


def test_the_pool_recovers_after_a_hang(ranks: RankPool) -> None:
    results = ranks.run(_train, "ddp", timeout=60, rows=[4, 4], steps=1, split_count=1)
    assert all(r["error"] <= RTOL for r in results)


def test_the_reference_is_not_trivial() -> None:
    before = _full(_plain_model().parameters())
    after = _reference([12, 12], 3)
    assert _relative_error(after, before) > 100 * RTOL
    assert math.isfinite(float(after.sum()))


# -- one rank: DDP and FSDP2 still reduce once per batch -------------------------------------------


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankPool]:
    pool = RankPool(tmp_path_factory.mktemp("one-rank"), world_size=1)
    yield pool
    pool.close()


def _one_rank_model(kind: str, options: dict[str, Any]) -> nn.Module:
    """DDP or FSDP2 as :func:`_distribute` makes them, or an FSDP2 layout the several-rank scheme refuses."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    model = _plain_model()
    if kind == "fsdp-shard-1":
        return fully_shard(model, mesh=_mesh(), shard_placement_fn=lambda p: Shard(p.dim() - 1))
    if kind == "fsdp-root-not-sharded":
        fully_shard(model[0], mesh=_mesh())
        return model
    return _distribute(kind, model, **options)


def _alone(rank: int, world: int, kind: str, options: dict[str, Any]) -> dict[str, Any]:
    """3 steps of split 3 on one rank, an OOM in the second forward: the scheme, DDP's syncs, the collectives."""
    model = _one_rank_model(kind, options)
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    (oom,) = _injections(model, [("forward", "model", [1], 0)])
    syncing: list[bool] = []  # per microbatch: whether DDP would reduce in its backward
    if kind == "ddp":
        _inner(model).register_forward_pre_hook(lambda *_: syncing.append(model.require_backward_grad_sync))
    per_step = []
    for i in range(3):
        optimizer.zero_grad(set_to_none=True)
        with _counting_collectives() as counts:
            step.backward(_batch(i, rank, 12), _loss_fn(model))
        optimizer.step()
        per_step.append(counts)
    return {
        "error": _relative_error(_full(model.parameters()), _reference([12], 3)),
        "scheme": type(getattr(step.sync, "active", step.sync)).__name__,  # gather="auto": the scheme it chose
        "syncing": syncing,
        "per_step": per_step,
        "fired": oom.fired,
    }


ALONE = {
    # kind, options, the scheme, DDP's reductions in a step that fitted, and the reduce-scatters that
    # ElasticStep starts in each step (FSDP2 skips its own on one rank)
    "ddp": ("ddp", {}, "SingleRankDDP", 0, [0, 0, 0]),
    "ddp-static-graph": ("ddp", {"static_graph": True}, "GradientSync", 3, [0, 0, 0]),  # its first backward: DDP's
    "fsdp": ("fsdp", {}, "FullyShard", 0, [2, 1, 1]),  # the OOM's attempt and its retry each vote in one
    # a layout that gathering once refuses: per module, FSDP2 reduces each microbatch itself
    "fsdp-shard-1": ("fsdp-shard-1", {}, "ShardPerModule", 0, [0, 0, 0]),
    "fsdp-root-not-sharded": ("fsdp-root-not-sharded", {}, "GradientSync", 0, [0, 0, 0]),
}


@pytest.mark.parametrize(("kind", "options", "scheme", "reductions", "scatters"), list(ALONE.values()), ids=list(ALONE))
def test_one_rank_reduces_once_a_batch_and_matches_full_batch_training(
    one_rank: RankPool, kind: str, options: dict[str, Any], scheme: str, reductions: int, scatters: list[int]
) -> None:
    """On one rank, DDP's reducer would reduce every microbatch and FSDP2 reshard and reduce each: 1.2-1.5x a step.

    FSDP2 layouts that several ranks cannot use keep FSDP2's own reduction here, exact as before.
    """
    (result,) = one_rank.run(_alone, kind, options, timeout=60)
    assert result["fired"] == 1
    assert result["error"] <= RTOL, f"relative weight error {result['error']:.2e}"
    assert result["scheme"] == scheme
    assert [counts[SCATTER] for counts in result["per_step"]] == scatters
    if kind == "ddp":
        assert sum(result["syncing"][-3:]) == reductions  # the last step's three microbatches

"""FSDP2 gathered per module (issue 15): FSDP2's own memory, an OOM on one rank anywhere never a hang.

Two gloo ranks (four for HSDP), each case under a 60 s deadline (``support.ranks.RankPool``).
The model has four FSDP2 units (its linear layers) under an FSDP2 root. The reference is plain
full-batch training on the union of the ranks' batches, in float32; weights must match it within
``RTOL``. OOMs are injected on one rank, or on both at different points: in the forward of the
first, a middle or the last unit, in their backward, in the allocation of an all-gather's output
or of a reduce-scatter's input, at the first, a middle or the last microbatch: in an attempt
whose collectives are guarded one by one, and in one that follows a script (its third step
with the same microbatch count), where the rank that fails stands in for its collectives.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import elastic_batches as eb
from elastic_batches import distributed
from elastic_batches.testing import (
    MemoryBudget,
    inject_oom,
    inject_oom_in_all_gather,
    inject_oom_in_reduce_scatter,
)

from support.ranks import RankPool

RTOL = 1e-5
LR = 0.1
SPLIT = 3  # microbatches at the start: 12 rows as 3 x 4
UNITS = (0, 2, 4, 6)  # the FSDP2 units: the linear layers of _model
SCRIPTED_STEP = 2  # steps 0 and 1 guard every collective and agree on the script; step 2 follows it
_MESHES: dict[tuple[int, ...], Any] = {}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankPool]:
    pool = RankPool(tmp_path_factory.mktemp("fsdp2-ranks"), world_size=2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankPool]:
    pool = RankPool(tmp_path_factory.mktemp("hsdp-ranks"), world_size=4)
    yield pool
    pool.close()


# -- helpers that run on the ranks -------------------------------------------------------------


def _model(width: int = 16, features: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(features, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
        nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1),
    )  # fmt: skip


def _mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _MESHES:
        names = ("replicate", "shard") if len(shape) == 2 else None
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[shape]


def _shard(model: nn.Sequential, layout: str = "mesh", **kwargs: Any) -> nn.Module:
    """FSDP2 on each linear layer, then the root: over a 1-D mesh, the default mesh, or HSDP's (2, 2)."""
    from torch.distributed.fsdp import fully_shard

    if layout == "default":  # PyTorch's tutorial form: no mesh=, a new equal mesh per call
        mesh_kwargs: dict[str, Any] = {}
    elif layout == "hsdp":
        mesh_kwargs = {"mesh": _mesh((2, dist.get_world_size() // 2))}
    else:
        mesh_kwargs = {"mesh": _mesh((dist.get_world_size(),))}
    for index in UNITS:
        fully_shard(model[index], **mesh_kwargs, **kwargs)
    return fully_shard(model, **mesh_kwargs, **kwargs)


def _batch(step: int, rank: int, rows: int, features: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(rows, features, generator=generator)
    return x, x[:, :1].sin() + 0.1 * torch.randn(rows, 1, generator=generator)


def _loss_fn(model: nn.Module) -> Any:
    return lambda mb: nn.functional.mse_loss(model(mb[0]), mb[1])


def _full(tensors: Any) -> torch.Tensor:
    parts = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in tensors]
    return torch.cat([p.detach().reshape(-1) for p in parts])


def _reference(rows: list[int], steps: int, max_grad_norm: float | None = None, **model: Any) -> torch.Tensor:
    """Plain full-batch SGD on the union of every rank's batch, every step."""
    plain = _model(**model)
    optimizer = torch.optim.SGD(plain.parameters(), lr=LR)
    for step in range(steps):
        x, y = zip(*(_batch(step, r, n, plain[0].in_features) for r, n in enumerate(rows)), strict=True)
        optimizer.zero_grad()
        nn.functional.mse_loss(plain(torch.cat(x)), torch.cat(y)).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), max_grad_norm)
        optimizer.step()
    return _full(plain.parameters())


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _injections(model: nn.Sequential, plan: list[tuple[Any, ...]]) -> list[Any]:
    """``(phase, unit, calls, rank)``: phase forward/backward of unit 0..3, or all_gather/reduce_scatter (unit None)."""
    handles = []
    for phase, unit, calls, rank in plan:
        if phase == "all_gather":
            handles.append(inject_oom_in_all_gather(calls=calls, rank=rank))
        elif phase == "reduce_scatter":
            handles.append(inject_oom_in_reduce_scatter(calls=calls, rank=rank))
        else:
            handles.append(inject_oom(model[UNITS[unit]], phase=phase, calls=calls, rank=rank))
    return handles


def _train(
    rank: int,
    world: int,
    gather: str,
    *,
    rows: list[int] | None = None,
    steps: int = 2,
    plan: list[tuple[Any, ...]] | None = None,
    layout: str = "mesh",
    max_grad_norm: float | None = None,
    shard_options: dict[str, Any] | None = None,
    oom_step: int = 0,
) -> dict[str, Any]:
    """Train ``steps`` steps; the ``plan``'s injections are armed just before step ``oom_step``."""
    rows = rows or [12] * world
    model = _shard(_model(), layout, **(shard_options or {}))
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=SPLIT), gather=gather)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    handles: list[Any] = []
    counts, scripted = [], []
    sync = step.sync
    for i in range(steps):
        if i == oom_step:
            handles = _injections(model, plan or [])
        optimizer.zero_grad(set_to_none=True)
        scripted.append(_scripted(sync))
        step.backward(_batch(i, rank, rows[rank]), _loss_fn(model))
        step.optimizer_step(optimizer, max_grad_norm=max_grad_norm)
        counts.append(step.controller.split_count)
    fired = [h.fired for h in handles]
    for h in handles:
        h.remove()
    return {
        "error": _relative_error(_full(model.parameters()), _reference(rows, steps, max_grad_norm)),
        "fired": fired,
        "counts": counts,
        "ooms": step.controller.oom_count,
        "retries": step.controller.retry_count,
        "scheme": type(getattr(sync, "active", sync)).__name__,
        "rows": rows,
        "scripted": scripted,  # per step: whether its first attempt followed a script
        "stood_in": sync.guard.stood_in if isinstance(sync, distributed.fsdp2_modules.ShardPerModule) else 0,
    }


def _scripted(sync: Any) -> bool:
    """Whether a backward attempt of ``SPLIT`` microbatches would follow a script now (per-module gathering)."""
    sync = getattr(sync, "active", sync)
    return isinstance(sync, distributed.fsdp2_modules.ShardPerModule) and (
        sync.scripts.script(("backward", True, SPLIT)) is not None
    )


def _check(results: list[dict[str, Any]], plan: list[tuple[Any, ...]], ooms: int | None = None) -> None:
    """Every rank fired what the plan aims at it, learned every OOM, retried alike, and trained exactly."""
    for rank, result in enumerate(results):
        assert result["fired"] == [1 if p[3] in (rank, None) else 0 for p in plan], f"rank {rank}: {result['fired']}"
        assert result["error"] <= RTOL, f"rank {rank}: relative weight error {result['error']:.2e}"
    expected = ooms if ooms is not None else len({id(p) for p in plan})
    assert [r["ooms"] for r in results] == [expected] * len(results)  # every rank learned of every OOM
    assert [r["retries"] for r in results] == [expected] * len(results)
    if len(set(results[0]["rows"])) == 1:  # the same batches: the same split counts (else each plans its own)
        assert all(r["counts"] == results[0]["counts"] for r in results)


# -- exactness, no OOM ---------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [[12, 12], [12, 7]], ids=["same-batch", "different-batches"])
@pytest.mark.parametrize("gather", ["module", "attempt", "auto"])
def test_every_mode_matches_full_batch_training(ranks: RankPool, gather: str, rows: list[int]) -> None:
    results = ranks.run(_train, gather, rows=rows, timeout=60)
    _check(results, [], ooms=0)
    expected = {"module": "ShardPerModule", "attempt": "FullyShard", "auto": "FullyShard"}[gather]
    assert [r["scheme"] for r in results] == [expected, expected]


# -- an OOM on one rank, anywhere: every rank retries, no hang, exact -----------------------------

# (phase, unit, forward call = microbatch of the first attempt, rank)
UNIT_PLANS = {
    f"{phase}-{unit_name}-unit-{mb_name}-mb": [(phase, unit, [mb], 1)]
    for phase in ("forward", "backward")
    for unit_name, unit in (("first", 0), ("middle", 2), ("last", 3))
    for mb_name, mb in (("first", 0), ("middle", 1), ("last", 2))
}


@pytest.mark.parametrize("plan", list(UNIT_PLANS.values()), ids=list(UNIT_PLANS))
def test_per_module_an_oom_in_a_unit_on_one_rank_retries_on_every_rank(ranks: RankPool, plan: list[Any]) -> None:
    _check(ranks.run(_train, "module", plan=plan, timeout=60), plan)


# The first attempt (3 microbatches, per module: 4 all-gathers in forward, 4 in backward, 4 reduce-scatters
# each; gathered once: 4 all-gathers in all): the first, a middle and the last of them.
COLLECTIVE_PLANS = {
    "module-all-gather-first": ("module", [("all_gather", None, [0], 1)]),
    "module-all-gather-middle": ("module", [("all_gather", None, [11], 1)]),
    "module-all-gather-last": ("module", [("all_gather", None, [23], 1)]),
    "module-reduce-scatter-first": ("module", [("reduce_scatter", None, [0], 1)]),
    "module-reduce-scatter-middle": ("module", [("reduce_scatter", None, [5], 1)]),
    "module-reduce-scatter-last": ("module", [("reduce_scatter", None, [11], 1)]),
    "attempt-all-gather-first": ("attempt", [("all_gather", None, [0], 1)]),
    "attempt-all-gather-middle": ("attempt", [("all_gather", None, [2], 1)]),
    "attempt-all-gather-last": ("attempt", [("all_gather", None, [3], 0)]),
}


@pytest.mark.parametrize(("gather", "plan"), list(COLLECTIVE_PLANS.values()), ids=list(COLLECTIVE_PLANS))
def test_an_oom_allocating_a_collectives_buffer_on_one_rank_retries_on_every_rank(
    ranks: RankPool, gather: str, plan: list[Any]
) -> None:
    """Gathered once, this hung before: the rank that failed unsharding left its peer in the next all-gather."""
    _check(ranks.run(_train, gather, plan=plan, timeout=60), plan)


BOTH_RANKS = {
    # rank 0 in the first attempt, rank 1 in the retry (4 microbatches: its forward calls 3..6)
    "forward-first-unit-then-backward-last-unit": [("forward", 0, [0], 0), ("backward", 3, [5], 1)],
    "backward-middle-unit-then-reduce-scatter": [("backward", 2, [2], 0), ("reduce_scatter", None, [14], 1)],
    # both in the first attempt's second microbatch: rank 0 in the third unit's forward, after its all-gather,
    # rank 1 allocating the fourth unit's all-gather (its 12th)
    "forward-and-all-gather-same-attempt": [("forward", 2, [1], 0), ("all_gather", None, [11], 1)],
}


@pytest.mark.parametrize("plan", list(BOTH_RANKS.values()), ids=list(BOTH_RANKS))
def test_per_module_ooms_on_both_ranks_at_different_points(ranks: RankPool, plan: list[Any]) -> None:
    results = ranks.run(_train, "module", plan=plan, timeout=60)
    same_attempt = plan is BOTH_RANKS["forward-and-all-gather-same-attempt"]
    _check(results, plan, ooms=1 if same_attempt else 2)


# -- the default mesh, shard_placement_fn, clipping --------------------------------------------------


@pytest.mark.parametrize("gather", ["module", "attempt"])
def test_the_default_mesh_trains_exactly_through_an_oom_on_one_rank(ranks: RankPool, gather: str) -> None:
    plan = [("backward", 2, [1], 1)]
    _check(ranks.run(_train, gather, plan=plan, layout="default", timeout=60), plan)


def _shard_dim_1(rank: int, world: int, gather: str) -> dict[str, Any]:
    return _train(rank, world, gather, plan=[("forward", 1, [1], 0)], shard_options={"shard_placement_fn": _dim_1})


def _dim_1(p: torch.Tensor) -> Any:
    from torch.distributed.tensor import Shard

    return Shard(p.dim() - 1)


@pytest.mark.parametrize("gather", ["module", "auto"])
def test_shard_placement_fn_trains_per_module(ranks: RankPool, gather: str) -> None:
    """Gathering once reduces Shard(0) rows only: "auto" gathers such a model per module."""
    results = ranks.run(_shard_dim_1, gather, timeout=60)
    _check(results, [("forward", 1, [1], 0)])
    assert [r["scheme"] for r in results] == ["ShardPerModule"] * 2


def test_per_module_clipping_matches_clip_grad_norm(ranks: RankPool) -> None:
    plan = [("backward", 0, [2], 0)]
    _check(ranks.run(_train, "module", plan=plan, rows=[12, 7], max_grad_norm=0.05, timeout=60), plan)


# -- what every rank must share: as many microbatches, the same collectives --------------------------


class _Branch(nn.Module):
    """A unit of two layers; ``b`` is used only where ``both``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 1), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, both: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if both else self.a(x)


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.branch = nn.Linear(6, 6), _Branch()

    def forward(self, x: torch.Tensor, both: bool) -> torch.Tensor:
        return self.branch(self.first(x), both)


def _mismatch(rank: int, world: int, case: str, agreeing_steps: int) -> str:
    """Ranks that start different collectives after ``agreeing_steps`` steps that did not (2: a scripted attempt)."""
    from torch.distributed.fsdp import fully_shard

    if case == "unused":  # rank 1 leaves b unused: its reduce-scatter of the unit holds fewer elements
        inner = _Branchy()
        fully_shard(inner.branch, mesh=_mesh((world,)))
        model = fully_shard(inner, mesh=_mesh((world,)))

        def loss_fn(mb: Any, both: bool = rank == 0) -> torch.Tensor:
            return nn.functional.mse_loss(model(mb[0], both=both), mb[1])

        agreeing: Any = functools.partial(loss_fn, both=True)
        rows = 12
    else:  # rank 1: 2 rows, so 2 microbatches where rank 0 runs 3
        model = _shard(_model())
        loss_fn = agreeing = _loss_fn(model)
        rows = 12 if rank == 0 else 2
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=SPLIT), gather="module")
    for _ in range(agreeing_steps):
        step.backward(_batch(0, rank, 12), agreeing)
    with pytest.raises(RuntimeError) as raised:
        step.backward(_batch(0, rank, rows), loss_fn)
    dist.barrier()  # every rank got here: none waits in a collective
    return str(raised.value)


MISMATCHES = {
    "fewer-microbatches": r"finished the attempt's FSDP2 collectives while rank 0|rank\(s\) \[0\] raised an error",
    "unused": r"about to start different FSDP2 collectives.*set_reduce_scatter_unused_params",
}


@pytest.mark.parametrize("agreeing_steps", [0, SCRIPTED_STEP], ids=["guarded", "scripted"])
@pytest.mark.parametrize(("case", "message"), list(MISMATCHES.items()), ids=list(MISMATCHES))
def test_ranks_that_would_start_different_collectives_raise_instead_of_hanging(
    ranks: RankPool, case: str, message: str, agreeing_steps: int
) -> None:
    """Scripted, the rank whose collectives differ leaves the script; the retry, guarded, raises."""
    import re

    for error in ranks.run(_mismatch, case, agreeing_steps, timeout=60):
        assert re.search(message, error), error


# -- gradients of earlier batches, evaluation -------------------------------------------------------


def _outer(rank: int, world: int) -> dict[str, Any]:
    """Two batches accumulated before one optimizer step; rank 1 runs out of memory in the second's last microbatch."""
    model = _shard(_model())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=SPLIT), gather="module")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    step.backward(_batch(0, rank, 12), _loss_fn(model))
    with inject_oom(model[UNITS[3]], phase="backward", calls=[2], rank=1) as oom:
        step.backward(_batch(1, rank, 12), _loss_fn(model))
    optimizer.step()
    plain = _model()
    reference = torch.optim.SGD(plain.parameters(), lr=LR)
    for i in range(2):
        x, y = zip(*(_batch(i, r, 12) for r in range(world)), strict=True)
        nn.functional.mse_loss(plain(torch.cat(x)), torch.cat(y)).backward()
    reference.step()
    return {"error": _relative_error(_full(model.parameters()), _full(plain.parameters())), "fired": oom.fired}


def test_gradients_of_earlier_batches_survive_a_retry(ranks: RankPool) -> None:
    results = ranks.run(_outer, timeout=60)
    assert [r["fired"] for r in results] == [0, 1]
    for result in results:
        assert result["error"] <= RTOL


def _evaluate(rank: int, world: int) -> dict[str, Any]:
    model = _shard(_model())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=SPLIT), gather="module")
    x, _ = _batch(0, rank, 12)
    with torch.no_grad(), inject_oom(model[UNITS[2]], phase="forward", calls=[1], rank=0):
        out = step.evaluate(x, model, combine=lambda outputs, microbatches: torch.cat(outputs))
        whole = model(x)
    return {"error": _relative_error(out, whole), "ooms": step.controller.oom_count}


def test_evaluate_per_module_retries_an_oom_on_one_rank(ranks: RankPool) -> None:
    for result in ranks.run(_evaluate, timeout=60):
        assert result["ooms"] == 1 and result["error"] <= RTOL


# -- the collectives it adds ----------------------------------------------------------------------


def _counted(rank: int, world: int) -> list[dict[str, int]]:
    """Four steps per module at split 3: FSDP2's collectives, and the side channel's rounds, in each."""
    model = _shard(_model())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=SPLIT), gather="module")
    sync = step.sync
    assert isinstance(sync, distributed.fsdp2_modules.ShardPerModule)
    steps = []
    for i in range(4):
        rounds = sync.guard.rounds
        with _Counting() as counts:
            step.backward(_batch(i, rank, 12), _loss_fn(model))
        steps.append({**counts.calls, "rounds": sync.guard.rounds - rounds})
    return steps


class _Counting:
    """Counts FSDP2's all-gathers and reduce-scatters (its default comms' calls)."""

    def __enter__(self) -> _Counting:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

        self.calls = {"all_gathers": 0, "reduce_scatters": 0}
        self._originals = [(cls, cls.__call__) for cls in (DefaultAllGather, DefaultReduceScatter)]
        for (cls, original), name in zip(self._originals, self.calls, strict=True):
            cls.__call__ = self._counted(original, name)  # type: ignore[method-assign]
        return self

    def _counted(self, original: Any, name: str) -> Any:
        def call(comm: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return original(comm, *args, **kwargs)

        return call

    def __exit__(self, *exc: object) -> None:
        for cls, original in self._originals:
            cls.__call__ = original  # type: ignore[method-assign]


def test_per_module_guards_each_collective_until_two_attempts_agree_on_a_script(ranks: RankPool) -> None:
    for steps in ranks.run(_counted, timeout=60):
        # 3 microbatches of 4 units: 4 all-gathers in forward, 4 in backward (resharded after forward), 4
        # reduce-scatters; beyond them, the microbatch count's round and the vote's. The first two steps
        # guard every collective; their votes agree on the script, which the next steps follow.
        guarded = {"all_gathers": 24, "reduce_scatters": 12, "rounds": 24 + 12 + 2}
        scripted = {"all_gathers": 24, "reduce_scatters": 12, "rounds": 2}
        assert steps == [guarded, guarded, scripted, scripted]


# -- memory: FSDP2's own, and the model that does not fit gathered ----------------------------------

WIDE = {"width": 256, "features": 256}  # 4 units, ~0.8 MB of parameters: parameters and gradients dominate
WIDE_ROWS, WIDE_SPLIT = 128, 4


def _fsdp2_recipe(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], split: int) -> None:
    """FSDP2's own gradient accumulation: every microbatch's backward reduce-scatters into the sharded .grad."""
    x, y = batch
    for xi, yi in zip(x.tensor_split(split), y.tensor_split(split), strict=True):
        (nn.functional.mse_loss(model(xi), yi) * (len(xi) / len(x))).backward()


def _peak(run: Any, limit: int | None = None) -> int:
    """The per-rank peak of live bytes of ``run()`` under a MemoryBudget (storage resizes counted)."""
    with MemoryBudget(limit) as budget:
        run()
    return budget.peak_bytes


def _memory(rank: int, world: int) -> dict[str, Any]:
    batch = _batch(0, rank, WIDE_ROWS, WIDE["features"])
    peaks: dict[str, int] = {}
    recipe = _shard(_model(**WIDE))
    _fsdp2_recipe(recipe, batch, WIDE_SPLIT)  # FSDP2's lazy init outside the budget, as for ElasticStep below
    recipe.zero_grad(set_to_none=True)
    peaks["recipe"] = _peak(lambda: _fsdp2_recipe(recipe, batch, WIDE_SPLIT))
    for gather in ("module", "attempt"):
        model = _shard(_model(**WIDE))
        step = eb.ElasticStep(model, controller=eb.SplitController(split_count=WIDE_SPLIT), gather=gather)
        step.backward(batch, _loss_fn(model))  # the scheme's own buffers, made at the first step, are kept
        model.zero_grad(set_to_none=True)
        peaks[gather] = _peak(lambda: step.backward(batch, _loss_fn(model)))  # noqa: B023
    # The model that does not fit gathered: a budget just above FSDP2's own peak at split 4, from split 1.
    limit = int(1.05 * peaks["recipe"])
    outcomes: dict[str, Any] = {"limit": limit, "peaks": peaks}
    for gather in ("attempt", "auto", "module"):
        model = _shard(_model(**WIDE))
        step = eb.ElasticStep(model, controller=eb.SplitController(), gather=gather, memory=None)  # the OOM search
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        try:
            with MemoryBudget(limit):
                for i in range(2):
                    optimizer.zero_grad(set_to_none=True)
                    step.backward(_batch(i, rank, WIDE_ROWS, WIDE["features"]), _loss_fn(model))
                    step.optimizer_step(optimizer)
        except eb.ElasticOOMError as err:
            outcomes[gather] = {"raised": str(err)}
            continue
        reference = _reference([WIDE_ROWS] * world, 2, **WIDE)
        sync = step.sync
        outcomes[gather] = {
            "error": _relative_error(_full(model.parameters()), reference),
            "count": step.controller.split_count,
            "ooms": step.controller.oom_count,
            "scheme": type(getattr(sync, "active", sync)).__name__,
        }
    # FSDP2's own recipe trains under the same budget at the split the elastic step found
    recipe.zero_grad(set_to_none=True)
    _peak(lambda: _fsdp2_recipe(recipe, batch, outcomes["module"]["count"]), limit)
    return outcomes


@pytest.fixture(scope="module")
def memory(ranks: RankPool) -> list[dict[str, Any]]:
    return ranks.run(_memory, timeout=120)


def test_per_module_peak_is_within_1_10x_of_fsdp2s_own_recipe(memory: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(memory):
        peaks = result["peaks"]
        assert peaks["module"] <= 1.10 * peaks["recipe"], f"rank {rank}: {peaks}"
        # gathered once, the same step holds the unsharded parameters and gradients: 1.28x here
        assert peaks["attempt"] >= 1.2 * peaks["recipe"], f"rank {rank}: the model is not one that gathering hurts"


def test_a_model_that_does_not_fit_gathered_trains_per_module_through_oom_driven_splitting(
    memory: list[dict[str, Any]],
) -> None:
    """What failed before: the unsharded parameters and gradients exceed the budget, FSDP2's own recipe trains."""
    for rank, result in enumerate(memory):
        assert "raised" in result["attempt"], f"rank {rank}: gathering once fitted in {result['limit']} bytes"
        for gather in ("auto", "module"):
            outcome = result[gather]
            assert "raised" not in outcome, f"rank {rank}, gather={gather}: {outcome}"
            assert outcome["scheme"] == "ShardPerModule"
            assert outcome["ooms"] >= 1 and outcome["count"] > 1  # it split because it ran out of memory
            assert outcome["error"] <= RTOL, f"rank {rank}, gather={gather}: {outcome['error']:.2e}"


# -- auto: per module when gathered once cannot fit even the smallest microbatch ----------------------


def test_auto_falls_back_to_per_module_at_the_smallest_microbatch(ranks: RankPool) -> None:
    """2 rows at split 3: the first attempt is already at microbatch size 1, where "attempt" would raise."""
    plan = [("forward", 0, [0], 0)]
    results = ranks.run(_train, "auto", plan=plan, rows=[2, 2], timeout=60)
    _check(results, plan, ooms=1)
    assert [r["scheme"] for r in results] == ["ShardPerModule"] * 2


# -- HSDP: a (2, 2) mesh, replicate x shard, four ranks -------------------------------------------

HSDP_PLANS = {
    "module-forward-middle-unit-rank2": ("module", [("forward", 2, [1], 2)]),
    "module-all-gather-rank3": ("module", [("all_gather", None, [5], 3)]),
    "module-reduce-scatter-rank1": ("module", [("reduce_scatter", None, [6], 1)]),
    "attempt-backward-last-unit-rank2": ("attempt", [("backward", 3, [2], 2)]),
    "attempt-all-gather-rank3": ("attempt", [("all_gather", None, [2], 3)]),
}


@pytest.mark.parametrize(("gather", "plan"), list(HSDP_PLANS.values()), ids=list(HSDP_PLANS))
def test_hsdp_trains_exactly_through_an_oom_on_one_rank(four_ranks: RankPool, gather: str, plan: list[Any]) -> None:
    results = four_ranks.run(_train, gather, plan=plan, layout="hsdp", max_grad_norm=0.05, timeout=60)
    _check(results, plan)


# -- Lightning: ModelParallelStrategy with fully_shard in configure_model ----------------------------


def _lightning(rank: int, world: int, oom_step: int) -> dict[str, Any]:
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from elastic_batches.lightning import ElasticAccumulation, Trainer

    from support.fault_matrix import lightning_environment

    warnings.filterwarnings("ignore")
    lightning_environment(rank, world)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for index in UNITS:
                fully_shard(self.net[index], mesh=mesh)
            fully_shard(self, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=LR)

        def on_train_end(self) -> None:
            elastic = ElasticAccumulation.find(self.trainer)
            if elastic is not None:  # the scheme the callback's step used (gone after teardown)
                sync = elastic.step_for("train").sync
                schemes.append(type(sync).__name__)
                stood_in.append(sync.guard.stood_in)

    x, y = _batch(0, 0, 72)  # 3 steps of 12 rows per rank
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=12)
    weights: list[torch.Tensor] = []
    schemes: list[str] = []
    stood_in: list[int] = []
    fired = 0
    for elastic in (True, False):
        options = dict(accelerator="cpu", devices=world, logger=False, enable_checkpointing=False, max_steps=3)
        options.update(enable_progress_bar=False, enable_model_summary=False)
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
        module = Net()
        if elastic:
            callback = ElasticAccumulation(
                controllers={"train": eb.SplitController(split_count=SPLIT)}, gather="module"
            )
            trainer: Any = Trainer(accumulate_grad_batches="auto", callbacks=[callback], strategy=strategy, **options)
            # the second microbatch of step oom_step (SPLIT backward calls a step before it)
            with inject_oom(module.net[UNITS[1]], phase="backward", calls=[SPLIT * oom_step + 1], rank=1) as oom:
                trainer.fit(module, loader)
            fired = oom.fired
        else:
            trainer = pl.Trainer(strategy=strategy, **options)
            trainer.fit(module, loader)
        weights.append(_full(module.parameters()))
    return {
        "error": _relative_error(weights[0], weights[1]),
        "fired": fired,
        "scheme": schemes[0],
        "stood_in": stood_in[0],
    }


@pytest.mark.parametrize("oom_step", [0, SCRIPTED_STEP], ids=["guarded", "scripted"])
def test_lightning_model_parallel_trains_per_module_through_an_oom_on_rank_1(ranks: RankPool, oom_step: int) -> None:
    results = ranks.run(_lightning, oom_step, timeout=120)
    assert [r["fired"] for r in results] == [0, 1]
    assert [r["stood_in"] > 0 for r in results] == [False, oom_step == SCRIPTED_STEP]
    for result in results:
        assert result["scheme"] == "ShardPerModule"
        assert result["error"] <= RTOL, f"relative weight error against the plain Trainer {result['error']:.2e}"


# -- errors other than an OOM, FSDP1 ------------------------------------------------------------------


def _error_on_rank_1(rank: int, world: int, oom_step: int) -> str:
    model = _shard(_model())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=SPLIT), gather="module")
    for i in range(oom_step):
        step.backward(_batch(i, rank, 12), _loss_fn(model))
    calls = [0]

    def loss_fn(mb: Any) -> torch.Tensor:
        calls[0] += 1
        if rank == 1 and calls[0] == 2:  # in the second microbatch's forward, between two all-gathers
            raise KeyError("the user's bug")
        return _loss_fn(model)(mb)

    with pytest.raises(Exception) as raised:
        step.backward(_batch(oom_step, rank, 12), loss_fn)
    dist.barrier()
    return f"{type(raised.value).__name__}: {raised.value}"


@pytest.mark.parametrize("oom_step", [0, SCRIPTED_STEP], ids=["guarded", "scripted"])
def test_per_module_an_error_on_one_rank_raises_on_every_rank(ranks: RankPool, oom_step: int) -> None:
    errors = ranks.run(_error_on_rank_1, oom_step, timeout=60)
    assert errors[1] == 'KeyError: "the user\'s bug"'
    assert errors[0].startswith("RuntimeError") and "rank(s) [1] raised an error other than an OOM" in errors[0]


class FullyShardedDataParallel(nn.Module):  # named as FSDP1's wrapper, which needs an accelerator to be made
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)


def _fsdp1(rank: int, world: int) -> str:
    with pytest.raises(NotImplementedError) as raised:
        distributed.gradient_sync_for(FullyShardedDataParallel())
    return str(raised.value)


def test_fsdp1_is_refused_naming_fully_shard_and_model_parallel_strategy(ranks: RankPool) -> None:
    for message in ranks.run(_fsdp1, timeout=60):
        assert "FSDP1 (FullyShardedDataParallel)" in message
        assert "fully_shard" in message and "ModelParallelStrategy" in message


# -- attempts that follow a script: the rank that fails stands in for its collectives ---------------

SCRIPTED_PLANS = {
    **UNIT_PLANS,
    **{name: plan for name, (gather, plan) in COLLECTIVE_PLANS.items() if gather == "module"},
    # rank 0 fails in the script's attempt; rank 1, which ran all of it, in the retry (guarded: 4 microbatches)
    "both-forward-first-unit-then-backward-last-unit": BOTH_RANKS["forward-first-unit-then-backward-last-unit"],
    "both-backward-middle-unit-then-reduce-scatter": BOTH_RANKS["backward-middle-unit-then-reduce-scatter"],
    # both in the script's attempt, at the same collective: each stands in from there
    "both-forward-and-all-gather-same-attempt": BOTH_RANKS["forward-and-all-gather-same-attempt"],
}


@pytest.mark.parametrize("plan", list(SCRIPTED_PLANS.values()), ids=list(SCRIPTED_PLANS))
def test_an_oom_in_a_scripted_attempt_retries_on_every_rank(ranks: RankPool, plan: list[Any]) -> None:
    steps = SCRIPTED_STEP + 1
    results = ranks.run(_train, "module", plan=plan, steps=steps, oom_step=SCRIPTED_STEP, timeout=60)
    same_attempt = plan is BOTH_RANKS["forward-and-all-gather-same-attempt"]
    both = plan in BOTH_RANKS.values()
    _check(results, plan, ooms=2 if both and not same_attempt else 1)
    for rank, result in enumerate(results):
        assert result["scripted"] == [False, False, True], f"rank {rank}: {result['scripted']}"
    # the rank that failed first (rank 1 alone, or rank 0) started the rest of the script in its stead
    first = 0 if both else 1
    assert results[first]["stood_in"] > 0
    if not both:
        assert results[1 - first]["stood_in"] == 0


def _scripted_outside_collectives(rank: int, world: int, phase: str) -> dict[str, Any]:
    """Rank 1 fails before its first collective (a transfer) or after its last (the loss sum) in a scripted attempt."""
    from elastic_batches.testing import inject_oom_in_op, inject_oom_in_transfer

    model = _shard(_model())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=SPLIT), gather="module", device="cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    guard = step.sync.guard
    for i in range(SCRIPTED_STEP + 1):
        optimizer.zero_grad(set_to_none=True)
        injection = contextlib.nullcontext()
        if i == SCRIPTED_STEP and rank == 1:
            injection = (
                inject_oom_in_transfer(calls=0)
                if phase == "transfer"
                else inject_oom_in_op(torch.ops.aten.stack, calls=0)
            )
        with injection:
            step.backward(_batch(i, rank, 12), _loss_fn(model))
        step.optimizer_step(optimizer)
    return {
        "error": _relative_error(_full(model.parameters()), _reference([12] * world, SCRIPTED_STEP + 1)),
        "ooms": step.controller.oom_count,
        "stood_in": guard.stood_in,
    }


@pytest.mark.parametrize(("phase", "stood_in"), [("transfer", 36), ("sum", 0)])
def test_a_scripted_attempt_failing_before_its_first_or_after_its_last_collective(
    ranks: RankPool, phase: str, stood_in: int
) -> None:
    """Before the first: the failed rank starts all 36 of the script's collectives; after the last: none."""
    results = ranks.run(_scripted_outside_collectives, phase, timeout=60)
    assert [r["stood_in"] for r in results] == [0, stood_in]
    for result in results:
        assert result["ooms"] == 1 and result["error"] <= RTOL


def _evaluate_scripted(rank: int, world: int) -> dict[str, Any]:
    model = _shard(_model())
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=SPLIT), gather="module")
    errors = []
    with torch.no_grad():
        for i in range(3):  # the third follows the script the first two agreed on; rank 0 fails in it
            x, _ = _batch(i, rank, 12)
            injection = inject_oom(model[UNITS[1]], phase="forward", calls=[1], rank=0) if i == 2 else None
            with injection if injection is not None else contextlib.nullcontext():
                out = step.evaluate(x, model, combine=lambda outputs, microbatches: torch.cat(outputs))
            errors.append(_relative_error(out, model(x)))
    return {"errors": errors, "ooms": step.controller.oom_count, "stood_in": step.sync.guard.stood_in}


def test_a_scripted_evaluation_retries_an_oom_on_one_rank(ranks: RankPool) -> None:
    results = ranks.run(_evaluate_scripted, timeout=60)
    assert results[0]["stood_in"] > 0 and results[1]["stood_in"] == 0
    for result in results:
        assert result["ooms"] == 1 and max(result["errors"]) <= RTOL


class _Skippable(nn.Module):
    """Three FSDP2 units in a row; the middle one runs only while ``middle`` (the same on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.middle_layer, self.last = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 1)
        self.middle = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        if self.middle:
            h = torch.tanh(self.middle_layer(h))
        return self.last(h)


def _departing(rank: int, world: int, fails: str) -> dict[str, Any]:
    """Steps 0-1 agree on a script; step 2 skips the middle unit (on every rank), and rank 1 fails in it.

    ``fails="before"``: in the first unit's forward, before the collective that leaves the script
    (the middle unit's all-gather, skipped): rank 1 stands in for the script from there while
    rank 0 leaves it there. ``"after"``: in the last unit's forward of the third microbatch, in the
    retry (the attempt that left the script was void). The OOM makes the count 4: steps 3 and 4
    would agree on a script for it, which step 5 would follow.
    """
    from torch.distributed.fsdp import fully_shard

    model = _Skippable()
    for part in (model.first, model.middle_layer, model.last):
        fully_shard(part, mesh=_mesh((world,)))
    fully_shard(model, mesh=_mesh((world,)))
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=SPLIT), gather="module")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    plain = _Skippable()
    reference = torch.optim.SGD(plain.parameters(), lr=LR)
    rounds = []
    for i in range(6):
        model.middle = plain.middle = i != 2
        optimizer.zero_grad(set_to_none=True)
        before = step.sync.guard.rounds
        injection: Any = contextlib.nullcontext()
        if i == 2:
            unit, calls = (model.first, [0]) if fails == "before" else (model.last, [2])
            injection = inject_oom(unit, phase="forward", calls=calls, rank=1)
        with injection:
            step.backward(_batch(i, rank, 12), lambda mb: nn.functional.mse_loss(model(mb[0]), mb[1]))
        optimizer.step()
        rounds.append(step.sync.guard.rounds - before)
        x, y = zip(*(_batch(i, r, 12) for r in range(world)), strict=True)
        reference.zero_grad(set_to_none=True)
        nn.functional.mse_loss(plain(torch.cat(x)), torch.cat(y)).backward()
        reference.step()
    return {
        "error": _relative_error(_full(model.parameters()), _full(plain.parameters())),
        "rounds": rounds,
        "ooms": step.controller.oom_count,
        "scripts": step.sync.scripts.enabled,
        "stood_in": step.sync.guard.stood_in,
    }


@pytest.mark.parametrize("fails", ["before", "after"])
def test_a_step_whose_collectives_leave_the_script_is_tried_again_guarded(ranks: RankPool, fails: str) -> None:
    """Every rank leaves the script at the collective that differs and stands in for the rest: no hang, exact."""
    results = ranks.run(_departing, fails, timeout=60)
    # the script: 3 microbatches of 3 units, 3 all-gathers forward, 3 backward, 3 reduce-scatters each. Both
    # ranks stand in after its first (rank 1 failed there, or both left it at the skipped unit's all-gather).
    assert [r["stood_in"] for r in results] == [26, 26]
    for result in results:
        assert result["ooms"] == 1 and result["error"] <= RTOL
        assert result["scripts"] is False  # no script again for this model
        # 3 microbatches (then 4) of 3 units, resharded after forward, each of them guarded; + plan and vote
        assert result["rounds"][:2] == [3 * 9 + 2] * 2
        assert result["rounds"][3:] == [4 * 9 + 2] * 3


HSDP_SCRIPTED_PLANS = {
    "forward-middle-unit-rank2": [("forward", 2, [1], 2)],
    "all-gather-rank3": [("all_gather", None, [5], 3)],
    "reduce-scatter-rank1": [("reduce_scatter", None, [6], 1)],
}


@pytest.mark.parametrize("plan", list(HSDP_SCRIPTED_PLANS.values()), ids=list(HSDP_SCRIPTED_PLANS))
def test_hsdp_scripted_attempt_trains_exactly_through_an_oom_on_one_rank(four_ranks: RankPool, plan: list[Any]) -> None:
    steps = SCRIPTED_STEP + 1
    results = four_ranks.run(
        _train, "module", plan=plan, layout="hsdp", steps=steps, oom_step=SCRIPTED_STEP, timeout=60
    )
    _check(results, plan)
    failing = plan[0][3]
    assert all(r["scripted"] == [False, False, True] for r in results)
    assert [r["stood_in"] > 0 for r in results] == [rank == failing for rank in range(4)]


def _finishing_early(rank: int, world: int) -> dict[str, Any]:
    """A script of two all-gathers; rank 0's attempt ends after the first, rank 1 starts the second."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    from elastic_batches.distributed.guard import ALL_GATHER_OP, CollectiveGuard, ScriptDeparture, side_channel
    from elastic_batches.distributed.script import Collective, Script

    group = dist.group.WORLD
    collective = Collective(ALL_GATHER_OP, 4, torch.float32, "cpu", 0, world, 0, DefaultAllGather(), group, None, "cpu")
    guard = CollectiveGuard(side_channel(range(world)))
    guard.start(Script((collective, collective)))
    out = torch.empty(4)
    guard.before(ALL_GATHER_OP, 4, collective)
    dist.all_gather_into_tensor(out, out.narrow(0, 2 * rank, 2).fill_(rank + 1))
    if rank == 0:
        with pytest.raises(ScriptDeparture, match="left its script .2 collectives. at the end of the attempt"):
            guard.finish()
        guard.stand_in()
        return {"stood_in": guard.stood_in, "second": None}
    guard.before(ALL_GATHER_OP, 4, collective)
    second = torch.empty(4)
    dist.all_gather_into_tensor(second, second.narrow(0, 2, 2).fill_(7.0))
    guard.finish()
    return {"stood_in": guard.stood_in, "second": second.tolist()}


def test_a_rank_done_before_its_script_stands_in_for_the_rest(ranks: RankPool) -> None:
    """An attempt that ends before its script does leaves it there: the peer's all-gather completes."""
    assert ranks.run(_finishing_early, timeout=60) == [
        {"stood_in": 1, "second": None},
        {"stood_in": 0, "second": [0.0, 0.0, 7.0, 7.0]},  # the stand-in's shard: zeros
    ]


def _shrinking(rank: int, world: int) -> dict[str, Any]:
    """Steps 0-1 at split 2 agree on a script; in step 2 rank 1's memory holds split 4's peak, not split 2's.

    Its first attempt, scripted, runs out of memory for real (``MemoryBudget``), and its stand-ins
    allocate under that same budget.
    """
    batch = _batch(0, rank, WIDE_ROWS, WIDE["features"])
    peaks = {}
    for split in (2, 4):  # the step's own peak at each split, measured on a copy
        probe = _shard(_model(**WIDE))
        measured = eb.ElasticStep(probe, controller=eb.SplitController(split_count=split), gather="module")
        measured.backward(batch, _loss_fn(probe))
        probe.zero_grad(set_to_none=True)
        peaks[split] = _peak(lambda: measured.backward(batch, _loss_fn(probe)))  # noqa: B023
    limit = (peaks[2] + peaks[4]) // 2
    model = _shard(_model(**WIDE))
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2), gather="module")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for i in range(3):
        optimizer.zero_grad(set_to_none=True)
        budget = MemoryBudget(limit) if i == 2 and rank == 1 else contextlib.nullcontext()
        with budget:
            step.backward(_batch(i, rank, WIDE_ROWS, WIDE["features"]), _loss_fn(model))
        step.optimizer_step(optimizer)
    return {
        "peaks": peaks,
        "error": _relative_error(_full(model.parameters()), _reference([WIDE_ROWS] * world, 3, **WIDE)),
        "ooms": step.controller.oom_count,
        "count": step.controller.split_count,
        "stood_in": step.sync.guard.stood_in,
    }


def test_a_scripted_attempt_out_of_memory_for_real_stands_in_within_the_budget(ranks: RankPool) -> None:
    results = ranks.run(_shrinking, timeout=120)
    assert results[1]["peaks"][2] > results[1]["peaks"][4]  # the budget between them makes split 2 fail
    assert [r["stood_in"] > 0 for r in results] == [False, True]
    for result in results:
        assert result["ooms"] >= 1 and result["count"] > 2
        assert result["error"] <= RTOL, f"relative weight error {result['error']:.2e}"

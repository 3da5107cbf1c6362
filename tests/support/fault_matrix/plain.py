"""A cell in the plain loop (``ElasticStep.backward``, ``ElasticStep.optimizer_step``), the OOM injected as it says."""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import elastic_batches as eb
from elastic_batches.distributed import gradient_sync_for
from elastic_batches.testing import (
    inject_oom,
    inject_oom_in_cut,
    inject_oom_in_op,
    inject_oom_in_optimizer,
    inject_oom_in_transfer,
)

from support.fault_matrix.cells import (
    EVALUATED,
    GATHER,
    LR,
    MAX_GRAD_NORM,
    OOM_STEP,
    OVERLAP_BUCKET_BYTES,
    OVERLAPPED,
    SCRIPTED_SETTINGS,
    SPLIT,
    STEPS,
    Cell,
    IdModel,
    Snapshots,
    batch,
    flat,
    loss_of,
    oom_call,
    padded_batch,
    padded_loss,
    reference,
)
from support.fault_matrix.checks import id_check, weight_errors

__all__ = ["GradNormOOM", "distribute", "error_of", "result_of", "run_plain_cell"]


class _CountOOM:
    """A ``count_fn`` (rows, as without it) that runs out of memory itself at chosen calls."""

    def __init__(self, call: int | None) -> None:
        self.call, self.calls, self.fired = call, 0, 0

    def __call__(self, mb: dict[str, torch.Tensor]) -> int:
        index, self.calls = self.calls, self.calls + 1
        if index == self.call:
            self.fired += 1
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the fault matrix's count_fn)")
        return len(mb["id"])

    def remove(self) -> None:
        self.call = None


class GradNormOOM:
    """Makes ``ElasticStep``'s gradient-norm computation (the allocating part of clipping) run out of memory."""

    def __init__(self, step: eb.ElasticStep) -> None:
        self.sync = step.sync
        self.fired = 0

        def local_grad_sq_norm(grads: Any) -> float:
            self.fired += 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the fault matrix in the gradient norm)")

        self.sync.local_grad_sq_norm = local_grad_sq_norm  # type: ignore[method-assign]

    def remove(self) -> None:
        vars(self.sync).pop("local_grad_sq_norm", None)  # the class's method again


class _BucketOOM:
    """Runs out of memory where the last microbatch's backward starts a chosen bucket of DDP's schedule.

    ``position``: the first, middle or last bucket the backward starts; ``call``: which of the
    attempts that start it raises (from 0). The buckets before it have started; it and those
    after it are stood in for at the vote.
    """

    def __init__(self, step: eb.ElasticStep, position: str, call: int) -> None:
        schedule = step.sync._schedule  # type: ignore[attr-defined]
        self.plan = schedule.plan
        order = schedule.order
        self.bucket = order[{"first": 0, "middle": len(order) // 2, "last": len(order) - 1}[position]]
        self.call, self.calls, self.fired = call, 0, 0
        fill = self.plan.fill

        def fill_or_fail(index: int, parts: Any, scale: float = 1.0) -> torch.Tensor:
            if index == self.bucket and torch._C._current_graph_task_id() != -1:  # in a backward: its hook
                number, self.calls = self.calls, self.calls + 1
                if number == self.call:
                    self.fired += 1
                    raise torch.OutOfMemoryError("CUDA out of memory (injected by the fault matrix in a bucket)")
            return fill(index, parts, scale)

        self.plan.fill = fill_or_fail

    def remove(self) -> None:
        vars(self.plan).pop("fill", None)  # the class's method again


def _arm(cell: Cell, rank: int, rows: int, model: nn.Module, step: eb.ElasticStep, optimizer: Any) -> list[Any]:
    """The injections of step ``OOM_STEP`` on this rank (counted from their creation, just before the step)."""
    if not cell.fires_on(rank):
        return []
    if cell.phase == "clip":
        return [GradNormOOM(step)]
    if cell.phase == "step":
        return [inject_oom_in_optimizer(optimizer, calls=0)]
    call = oom_call(cell, rank, rows)
    assert call is not None
    if cell.phase == "transfer":
        return [inject_oom_in_transfer(calls=call)]
    if cell.phase == "cut":
        return [inject_oom_in_cut(calls=call)]
    if cell.phase == "count":
        return [_CountOOM(call)]
    if cell.phase == "sum":
        return [inject_oom_in_op(torch.ops.aten.stack, calls=call)]
    if cell.phase == "bucket":
        assert cell.position is not None
        return [_BucketOOM(step, cell.position, call)]
    first_layer = _inner(model).net[0]
    target = model if cell.phase == "forward" else first_layer
    return [inject_oom(target, phase=cell.phase, calls=call)]  # type: ignore[arg-type]


# -- distribution ----------------------------------------------------------------------------------

_MESH: Any = None


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    global _MESH
    if _MESH is None:
        _MESH = init_device_mesh("cpu", (dist.get_world_size(),))
    return _MESH


def distribute(setting: str, model: IdModel) -> nn.Module:
    if setting == "single":
        return model
    if setting in ("ddp", OVERLAPPED):
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard  # "fsdp2", "fsdp2-module", "fsdp2-script"

    for part in (model.net[0], model.net[2], model.ids):
        fully_shard(part, mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    return model


def _inner(model: nn.Module) -> Any:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def error_of(err: BaseException, step: int) -> dict[str, Any]:
    return {"type": type(err).__name__, "message": str(err), "step": step, "traceback": traceback.format_exc()}


# -- the plain loop ----------------------------------------------------------------------------------


def run_plain_cell(cell: Cell, rank: int = 0, world: int = 1, snapshots: Snapshots | None = None) -> dict:
    """Train the cell's ``STEPS`` steps with ``ElasticStep``; what happened, as plain values."""
    snapshots = snapshots if snapshots is not None else reference()
    model = distribute(cell.setting, IdModel())
    controller = eb.SplitController(split_count=SPLIT)
    device = "cpu" if cell.phase == "transfer" else None
    step = eb.ElasticStep(model, controller=controller, device=device, gather=GATHER.get(cell.setting, "auto"))
    if cell.setting == OVERLAPPED:
        step.sync = gradient_sync_for(model, bucket_bytes=OVERLAP_BUCKET_BYTES)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def loss_fn(mb: Any) -> torch.Tensor:
        if isinstance(mb, dict):
            return padded_loss(model, mb)
        x, y, ids = mb
        return loss_of(model(x, ids), y)

    ids_checks: list[dict[str, Any]] = []
    counts: list[int] = []
    fired = 0
    error: dict[str, Any] | None = None
    done = 0
    for i in range(STEPS):
        x, y, ids = batch(i, rank, world)
        data: Any = padded_batch(i, rank, world) if cell.phase in ("cut", "count") else (x, y, ids)
        if i == 0 and cell.setting in SCRIPTED_SETTINGS:
            _agree_on_a_script(step, data, loss_fn, counted=cell.phase == "count")
        if cell.setting == EVALUATED and i == OOM_STEP:  # between two training steps (before every one, all alike)
            _validate(step, model, x, ids)
        optimizer.zero_grad(set_to_none=True)
        handles = _arm(cell, rank, len(ids), model, step, optimizer) if i == OOM_STEP else []
        count_fn = next((h for h in handles if isinstance(h, _CountOOM)), _CountOOM(None))
        try:
            step.backward(data, loss_fn, count_fn=count_fn if cell.phase == "count" else None)
            counts.append(controller.split_count)
            ids_checks.append(id_check(flat([_inner(model).ids.weight.grad]), i))
            step.optimizer_step(optimizer, max_grad_norm=MAX_GRAD_NORM)
            done += 1
        except Exception as err:  # every rank must get here alike; the test says whether it should have
            error = error_of(err, i)
            break
        finally:
            fired += sum(h.fired for h in handles)
            for h in handles:
                h.remove()
    guard = getattr(step.sync, "guard", None) if cell.setting in SCRIPTED_SETTINGS else None
    stood_in = guard.stood_in if guard is not None else 0
    return result_of(cell, done, error, model, snapshots, ids_checks, counts, fired, controller, stood_in)


def _agree_on_a_script(step: eb.ElasticStep, data: Any, loss_fn: Any, counted: bool) -> None:
    """Two attempts of step 0's batch whose votes agree on its collectives' script; nothing of them is kept.

    Their gradients are dropped (each step starts from ``zero_grad``) and the controller's state
    is put back, so the run goes on as if they never ran, its attempts at ``SPLIT`` microbatches
    following the script.
    """
    state = step.controller.state_dict()
    for _ in range(2):
        step.backward(data, loss_fn, count_fn=_CountOOM(None) if counted else None)
    step.controller.load_state_dict(state)


def _validate(step: eb.ElasticStep, model: nn.Module, x: torch.Tensor, ids: torch.Tensor) -> None:
    """A validation between training steps: ``step.evaluate``, then a bare ``no_grad`` forward; nothing kept.

    The controller's state is put back, as after the warm-ups: the training steps run as without it.
    """
    state = step.controller.state_dict()
    with torch.no_grad():
        step.evaluate((x, ids), lambda mb: model(mb[0], mb[1]))
        model(x, ids)
    step.controller.load_state_dict(state)


def result_of(
    cell: Any,
    done: int,
    error: Any,
    model: nn.Module,
    snapshots: Any,
    ids_checks: Any,
    counts: Any,
    fired: int,
    controller: eb.SplitController,
    stood_in: int = 0,
) -> dict[str, Any]:
    """What one cell reports, the same for the plain loop and the Lightning Trainer.

    ``stood_in``: the collectives this rank started in a failed attempt's stead (per module, scripted).
    """
    whole, own = weight_errors(model.parameters(), snapshots)
    return {
        "cell": cell.id,
        "steps_done": done,
        "error": error,
        "weight_error": whole[done],
        "own_weight_errors": own,  # this rank's shards against the reference after 0..STEPS steps
        "ids": ids_checks,
        "counts": counts,
        "fired": fired,
        "retries": controller.retry_count,
        "discarded": controller.discarded_microbatches,
        "stood_in": stood_in,
    }

"""The fault-injection matrix of issue 6: where an OOM strikes, on which ranks, and what must follow.

A *cell* is one combination of

* the loop: ``"plain"`` (``ElasticStep.backward`` + ``ElasticStep.optimizer_step``) or
  ``"lightning"`` (``elastic_batches.lightning.Trainer(accumulate_grad_batches="auto")``);
* the setting: ``"single"`` (one process), ``"ddp"``, ``"fsdp2"`` (``gather="auto"``: this model
  gathers once an attempt) or ``"fsdp2-module"`` (``gather="module"``) on two gloo ranks;
* the phase the OOM strikes in: the device ``"transfer"`` of a microbatch, the ``"cut"`` of a
  padded microbatch (a loader with ``pad_values``), the ``"count"`` of its items (``count_fn``),
  its ``"forward"``, its ``"backward"`` (injected on the first layer, so later layers already
  hold gradients), the ``"sum"`` of the microbatch losses (``aten.stack``), the gradient norm of
  the ``"clip"``ping, the optimizer ``"step"``, or (Lightning only) a user ``"hook"``,
  ``on_before_optimizer_step``, which Lightning runs between the two;
* the microbatch: ``"first"``, ``"middle"`` or ``"last"`` of the attempt (per-microbatch phases);
* the ranks: ``"0"``, ``"1"`` or ``"both"`` (rank 0 in the first attempt, rank 1 in the retry
  that follows it; both in the same step for the phases after the microbatches).

Every cell trains a tiny model for ``STEPS`` steps of ``GLOBAL_ROWS`` samples (over all ranks),
starting at ``SPLIT`` microbatches, with the OOM injected in step ``OOM_STEP``. The model holds a
per-sample ``nn.Embedding(SAMPLES, 1)`` whose value is added to each sample's loss, so the
gradient of row ``id`` is exactly ``1 / GLOBAL_ROWS`` when sample ``id`` was used once in the
step, 0 when it was lost, ``2 / GLOBAL_ROWS`` when it was counted twice: every row is checked
after every backward. The outcome must be

* for everything between the start of an attempt and the vote (transfer, cut, count, forward,
  backward, sum): recovery, with weights equal (``RTOL``) to plain full-batch training on the
  same samples, which never ran out of memory;
* after the microbatches (hook, clipping, optimizer step), where splitting cannot help: an
  ``ElasticOOMError`` on every rank, naming where (``WHERE``, ``LIGHTNING_WHERE``) and the ranks,
  with the weights of the steps before it (no partial update) on the ranks that ran out of
  memory, and on every rank when the norm's vote caught it before any rank stepped; after an OOM
  in the step itself, the ranks whose step went through hold its update (documented, checked on
  each rank's own shards);

and never a hang (the distributed cells run in ``_distributed_harness.RankPool`` under a deadline).

``tests/test_fault_matrix.py`` asserts all of this; ``benchmarks/fault_matrix.py`` runs the same
cells and prints the table of ``docs/reliability.md``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import elastic_batches as eb
from elastic_batches.testing import (
    inject_oom,
    inject_oom_in_cut,
    inject_oom_in_op,
    inject_oom_in_optimizer,
    inject_oom_in_transfer,
)

SAMPLES = 72  # ids 0..71: STEPS batches of GLOBAL_ROWS, each sample used once
GLOBAL_ROWS = 24  # rows per step over all ranks
STEPS = 3
OOM_STEP = 1  # the step the OOM is injected in (step 0 settles the count first)
SPLIT = 3  # microbatches at the start
FEATURES = 6
WIDTH = 16
LR = 0.1
MAX_GRAD_NORM = 0.25  # every cell clips (the reference with torch's clip_grad_norm_)
RTOL = {"single": 1e-6, "ddp": 1e-5, "fsdp2": 1e-5, "fsdp2-module": 1e-5}  # float32, relative to the largest weight
ID_TOLERANCE = 1e-4  # |gradient x GLOBAL_ROWS - round(...)| per embedding row

LOOPS = ("plain", "lightning")
SETTINGS = ("single", "ddp", "fsdp2", "fsdp2-module")
GATHER = {"fsdp2-module": "module"}  # ElasticStep's gather= per setting; "auto" otherwise
PHASES = ("transfer", "cut", "count", "forward", "backward", "sum", "clip", "step")
MICROBATCH_PHASES = ("transfer", "cut", "count", "forward", "backward")  # struck at a chosen microbatch
RECOVERING_PHASES = (*MICROBATCH_PHASES, "sum")  # between the start of an attempt and the vote
# Lightning moves each batch to the device whole, before the step (no microbatch transfer to strike in);
# "hook" is an OOM in on_before_optimizer_step, which Lightning runs inside its optimizer step, before clipping.
LIGHTNING_PHASES = ("cut", "forward", "backward", "hook", "clip", "step")
POSITIONS = ("first", "middle", "last")
# What the ElasticOOMError names. Lightning runs its hooks, the clipping and the update inside one
# optimizer.step(closure): the integration names the norm, or that whole step.
WHERE = {"clip": "the gradient norm", "step": "optimizer.step()"}
LIGHTNING_WHERE = "the optimizer step (on_before_optimizer_step, gradient clipping or optimizer.step())"


@dataclasses.dataclass(frozen=True)
class Cell:
    """One point of the matrix (see the module docstring)."""

    loop: str
    setting: str
    phase: str
    position: str | None  # None for the phases after the microbatches
    ranks: str  # "0", "1" or "both" ("0" in one process)

    @property
    def id(self) -> str:
        parts = [self.loop, self.setting, self.phase]
        if self.position is not None:
            parts.append(self.position)
        if self.setting != "single":
            parts.append("both-ranks" if self.ranks == "both" else f"rank{self.ranks}")
        return "-".join(parts)

    @property
    def recovers(self) -> bool:
        """Whether splitting can help: the run must recover (else raise on every rank)."""
        return self.phase in RECOVERING_PHASES

    def fires_on(self, rank: int) -> bool:
        return self.ranks == "both" or self.ranks == str(rank)


def cells(loop: str, setting: str) -> list[Cell]:
    """The cells of one loop and setting, in table order."""
    rank_variants = ("0",) if setting == "single" else ("0", "1", "both")
    phases = PHASES if loop == "plain" else LIGHTNING_PHASES
    out = []
    for phase in phases:
        for position in POSITIONS if phase in MICROBATCH_PHASES else (None,):
            out.extend(Cell(loop, setting, phase, position, ranks) for ranks in rank_variants)
    return out


# -- data, model, reference ------------------------------------------------------------------------


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (SAMPLES, FEATURES) and ``y`` (SAMPLES, 1); sample ``i`` has id ``i``."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return x, x[:, :1].sin() + 0.1 * torch.randn(SAMPLES, 1, generator=generator)


def _shards() -> list[list[int]]:
    """Each of 2 ranks' sample ids in order: Lightning's ``DistributedSampler`` (shuffled, seed 0, epoch 0)."""
    from torch.utils.data import DistributedSampler

    return [list(DistributedSampler(range(SAMPLES), num_replicas=2, rank=r, shuffle=True, seed=0)) for r in range(2)]


def step_ids(step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    """The ids of ``rank``'s batch in ``step``; in one process, the union of both ranks' batches.

    Every setting trains on the same global batches: those Lightning's ``DistributedSampler``
    gives two ranks (it always shuffles training data), so one reference serves every cell.
    """
    rows = GLOBAL_ROWS // 2
    parts = [shard[step * rows : (step + 1) * rows] for shard in _shards()]
    return torch.tensor(parts[rank] if world == 2 else parts[0] + parts[1])


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = dataset()
    ids = step_ids(step, rank, world)
    return x[ids], y[ids], ids


def pad_length(sample_id: int) -> int:
    """The length of sample ``sample_id``'s variable-length field ``"pad"`` (1 to 5)."""
    return 1 + sample_id % 5


def padded_batch(step: int, rank: int = 0, world: int = 1) -> eb.ElasticBatch:
    """:func:`batch` padded as a loader with ``pad_values`` pads it: ``x``, ``y``, ``id`` and a ragged ``pad``."""
    x, y, ids = batch(step, rank, world)
    samples = [
        {"x": x[i], "y": y[i], "id": int(ids[i]), "pad": torch.ones(pad_length(int(ids[i])))} for i in range(len(ids))
    ]
    return eb.ElasticCollate(pad_values={"pad": 0.0})(samples)


def padded_loss(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """:func:`loss_of` on a padded microbatch; its ``pad`` field adds 0, so that each cut is used."""
    return loss_of(model(mb["x"], mb["id"]), mb["y"]) + 0.0 * mb["pad"].sum()


class IdModel(nn.Module):
    """An MLP, plus a per-sample embedding whose gradient counts how often each sample was used."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
        self.ids = nn.Embedding(SAMPLES, 1)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net(x), self.ids(ids)


def loss_of(outputs: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    """Mean over samples of ``(prediction - y)^2 + embedding[id]``: d loss / d embedding[id] = 1 / rows."""
    prediction, tag = outputs
    return ((prediction - y) ** 2 + tag).mean()


def flat(tensors: Any) -> torch.Tensor:
    """Every tensor, whole and flattened (a collective for FSDP2's DTensors: every rank calls it alike)."""
    parts = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in tensors]
    return torch.cat([p.detach().reshape(-1) for p in parts])


Snapshots = list[list[torch.Tensor]]  # the reference's parameters after 0..STEPS steps


def reference() -> Snapshots:
    """Plain full-batch training (clip, SGD) on each step's ``GLOBAL_ROWS`` samples: parameters after 0..STEPS steps."""
    model = IdModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    snapshots = [[p.detach().clone() for p in model.parameters()]]
    for step in range(STEPS):
        x, y, ids = batch(step)
        optimizer.zero_grad()
        loss_of(model(x, ids), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return snapshots


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def weight_errors(parameters: Any, snapshots: Snapshots) -> tuple[list[float], list[float]]:
    """Relative errors of the whole weights, and of this rank's own shards, against each snapshot.

    The whole weights (gathered: a collective under FSDP2) are what recovery is judged on; this
    rank's shards (all of them without FSDP2) tell which update this rank applied.
    """
    parameters = list(parameters)
    whole = flat(parameters)
    own, references = [], []
    for p in parameters:
        if hasattr(p, "to_local"):  # FSDP2: Shard(0) rows, torch.chunk's layout
            local = p.to_local()
            rows = -(-p.shape[0] // dist.get_world_size())
            start = dist.get_rank() * rows
            own.append(local.detach().reshape(-1))
            references.append(slice(start, start + local.shape[0]))
        else:
            own.append(p.detach().reshape(-1))
            references.append(slice(None))
    mine = torch.cat(own)
    whole_errors = [relative_error(whole, torch.cat([t.reshape(-1) for t in snapshot])) for snapshot in snapshots]
    own_errors = [
        relative_error(mine, torch.cat([t[part].reshape(-1) for t, part in zip(snapshot, references, strict=True)]))
        for snapshot in snapshots
    ]
    return whole_errors, own_errors


def id_check(grad: torch.Tensor, step: int) -> dict[str, Any]:
    """How often each sample of the dataset counted in ``step``'s gradient (from the embedding's gradient)."""
    counted = grad.detach().reshape(-1).double() * GLOBAL_ROWS
    rounded = counted.round()
    expected = torch.zeros(SAMPLES, dtype=torch.float64)
    expected[step_ids(step)] = 1.0
    result = {
        "off": float((counted - rounded).abs().max()),
        "lost": int(((expected == 1) & (rounded == 0)).sum()),
        "doubled": int((rounded >= 2).sum()),
        "stray": int(((expected == 0) & (rounded != 0)).sum()),
    }
    result["ok"] = result["off"] <= ID_TOLERANCE and result["lost"] == result["doubled"] == result["stray"] == 0
    return result


def predicted_counts(rows: int) -> tuple[int, int, int]:
    """Microbatch counts in step ``OOM_STEP``: its first attempt, the retry after one OOM, the retry after two."""
    controller = eb.SplitController(split_count=SPLIT)
    for _ in range(OOM_STEP):
        count = controller.plan(rows)
        controller.record_success(math.ceil(rows / count), rows)
    first = controller.plan(rows)
    controller.record_oom(math.ceil(rows / first), rows)
    retry = controller.plan(rows)
    controller.record_oom(math.ceil(rows / retry), rows)
    return first, retry, controller.plan(rows)


def expected_outcome(cell: Cell, rank: int, rows: int) -> tuple[int, int]:
    """The split count that step ``OOM_STEP`` succeeds with, and the microbatches ``rank`` threw away in it.

    The microbatches thrown away pin down where the OOM struck: a rank that fails at microbatch
    ``i`` of an attempt throws away ``i + 1`` (it stops there), the others all of the attempt's.
    """
    first, retry, third = predicted_counts(rows)
    if not cell.recovers:
        return first, 0
    if cell.ranks != "both":
        return retry, _discarded_by_failing(cell, first) if cell.fires_on(rank) else _discarded_by_peer(cell, first)
    if rank == 0:  # fails in the first attempt; runs all of the retry, in which rank 1 fails
        return third, _discarded_by_failing(cell, first) + _discarded_by_peer(cell, retry)
    return third, _discarded_by_peer(cell, first) + _discarded_by_failing(cell, retry)


def _discarded_by_peer(cell: Cell, count: int) -> int:
    """The microbatches a rank throws away in an attempt of ``count`` microbatches in which its peer fails.

    All of them, except where FSDP2's collectives are guarded per module: the rank stops at its
    first collective after the peer's failure, in the microbatch it fails in (``count_fn``: in
    the first one, after counting every microbatch), having started it.
    """
    if cell.setting != "fsdp2-module" or cell.phase == "sum":
        return count
    if cell.phase == "count":
        return 1
    assert cell.position is not None
    return _position(cell.position, count) + 1


def _discarded_by_failing(cell: Cell, count: int) -> int:
    """The microbatches a rank that fails in an attempt of ``count`` microbatches threw away.

    It stops at the failing microbatch, which it started (transfer, forward, backward) or not
    (its cut); ``count_fn`` runs on every microbatch before the first forward; the losses are
    summed after the last one.
    """
    if cell.phase == "sum":
        return count
    if cell.phase == "count":
        return 0
    assert cell.position is not None
    index = _position(cell.position, count)
    return index if cell.phase == "cut" else index + 1


def _position(position: str, count: int) -> int:
    return {"first": 0, "middle": count // 2, "last": count - 1}[position]


def oom_call(cell: Cell, rank: int, rows: int) -> int | None:
    """The call (forward, or transfer) of step ``OOM_STEP`` that raises on ``rank``, counted from 0; None: none.

    Rank 0 (or either rank alone) strikes in the first attempt. With ``"both"``, rank 1 strikes in
    the retry caused by rank 0: it ran every microbatch of the first attempt (``first`` calls).
    """
    if not cell.recovers or not cell.fires_on(rank):
        return None
    second = cell.ranks == "both" and rank == 1  # strikes in the retry
    if cell.phase == "sum":  # one sum an attempt
        return int(second)
    assert cell.position is not None
    first, retry, _ = predicted_counts(rows)
    if second:
        return _calls_before_peer_failed(cell, first) + _position(cell.position, retry)
    return _position(cell.position, first)


def _calls_before_peer_failed(cell: Cell, count: int) -> int:
    """The calls (of the cell's phase) a rank makes in an attempt of ``count`` microbatches in which its peer fails.

    All of them, except where FSDP2's collectives are guarded per module: the rank stops in the
    microbatch its peer fails in, after that microbatch's call (``count_fn``: after every
    microbatch's, which come first).
    """
    if cell.setting != "fsdp2-module" or cell.phase == "count":
        return count
    assert cell.position is not None
    return _position(cell.position, count) + 1


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


class _GradNormOOM:
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


def _arm(cell: Cell, rank: int, rows: int, model: nn.Module, step: eb.ElasticStep, optimizer: Any) -> list[Any]:
    """The injections of step ``OOM_STEP`` on this rank (counted from their creation, just before the step)."""
    if not cell.fires_on(rank):
        return []
    if cell.phase == "clip":
        return [_GradNormOOM(step)]
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
    if setting == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard  # "fsdp2", "fsdp2-module"

    for part in (model.net[0], model.net[2], model.ids):
        fully_shard(part, mesh=_mesh())
    return fully_shard(model, mesh=_mesh())


def _inner(model: nn.Module) -> Any:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _error(err: BaseException, step: int) -> dict[str, Any]:
    return {"type": type(err).__name__, "message": str(err), "step": step, "traceback": traceback.format_exc()}


# -- the plain loop ----------------------------------------------------------------------------------


def run_plain_cell(cell: Cell, rank: int = 0, world: int = 1, snapshots: Snapshots | None = None) -> dict:
    """Train the cell's ``STEPS`` steps with ``ElasticStep``; what happened, as plain values."""
    snapshots = snapshots if snapshots is not None else reference()
    model = distribute(cell.setting, IdModel())
    controller = eb.SplitController(split_count=SPLIT)
    device = "cpu" if cell.phase == "transfer" else None
    step = eb.ElasticStep(model, controller=controller, device=device, gather=GATHER.get(cell.setting, "auto"))
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
            error = _error(err, i)
            break
        finally:
            fired += sum(h.fired for h in handles)
            for h in handles:
                h.remove()
    return _result(cell, done, error, model, snapshots, ids_checks, counts, fired, controller)


def _result(
    cell: Any,
    done: int,
    error: Any,
    model: nn.Module,
    snapshots: Any,
    ids_checks: Any,
    counts: Any,
    fired: int,
    controller: eb.SplitController,
) -> dict[str, Any]:
    """What one cell reports, the same for the plain loop and the Lightning Trainer."""
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
    }


# -- the Lightning Trainer -------------------------------------------------------------------------


def _lightning_module(cell: Cell, rank: int, rows: int) -> Any:
    """A LightningModule training :class:`IdModel`, with the cell's injection installed at ``on_fit_start``."""
    import lightning.pytorch as pl

    from elastic_batches.lightning import ElasticAccumulation

    class FaultySGD(torch.optim.SGD):
        """SGD that runs out of memory in chosen steps, after the closure (where an optimizer allocates its state)."""

        def __init__(self, params: Any, fail_at: int | None) -> None:
            super().__init__(params, lr=LR)
            self.fail_at, self.calls, self.fired = fail_at, 0, 0

        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            index, self.calls = self.calls, self.calls + 1
            if index == self.fail_at:
                self.fired += 1
                raise torch.OutOfMemoryError("CUDA out of memory (injected by the fault matrix in SGD.step)")
            super().step()
            return loss

    class IdModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            model = IdModel()
            self.net, self.ids = model.net, model.ids
            self.ids_checks: list[dict[str, Any]] = []
            self.counts: list[int] = []  # the controller's split count after each step
            self.fired = 0
            self._handles: list[Any] = []
            self.optimizer: FaultySGD | None = None

        def configure_model(self) -> None:
            if cell.setting.startswith("fsdp2"):
                _shard(self, (self.net[0], self.net[2], self.ids))

        def on_fit_start(self) -> None:
            call = oom_call(cell, rank, rows)
            if call is None:
                return
            if cell.phase == "cut":
                self._handles = [inject_oom_in_cut(calls=OOM_STEP * SPLIT + call)]
                return
            target = self.net if cell.phase == "forward" else self.net[0]
            self._handles = [inject_oom(target, phase=cell.phase, calls=OOM_STEP * SPLIT + call)]  # type: ignore

        def on_fit_end(self) -> None:
            self._release()

        def _release(self) -> None:
            self.fired += sum(h.fired for h in self._handles)
            for h in self._handles:
                h.remove()
            self._handles = []

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = loss_of((self.net(batch["x"]), self.ids(batch["id"])), batch["y"])
            return loss + 0.0 * batch["pad"].sum() if "pad" in batch else loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.counts.append(ElasticAccumulation.find(self.trainer).controllers["train"].split_count)

        def _strikes(self, phase: str) -> bool:
            return cell.phase == phase and cell.fires_on(rank) and self.trainer.global_step == OOM_STEP

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.ids_checks.append(id_check(flat([self.ids.weight.grad]), self.trainer.global_step))
            if self._strikes("hook"):
                self.fired += 1
                raise torch.OutOfMemoryError("CUDA out of memory (injected by the fault matrix in a user hook)")

        def configure_gradient_clipping(
            self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
        ) -> None:
            if not self._strikes("clip"):
                self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
                return
            injection = _GradNormOOM(ElasticAccumulation.find(self.trainer).step_for("train"))
            try:
                self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            finally:
                self.fired += injection.fired
                injection.remove()

        def configure_optimizers(self) -> Any:
            fail_at = OOM_STEP if cell.phase == "step" and cell.fires_on(rank) else None
            self.optimizer = FaultySGD(self.parameters(), fail_at)
            return self.optimizer

    return IdModule()


class _Rows(torch.utils.data.Dataset):
    """The samples as dicts; with ``padded``, each with its ragged ``pad`` field too."""

    def __init__(self, padded: bool = False) -> None:
        self.x, self.y = dataset()
        self.padded = padded

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample: dict[str, Any] = {"x": self.x[index], "y": self.y[index], "id": index}
        if self.padded:
            sample["pad"] = torch.ones(pad_length(index))
        return sample


def _trainer(setting: str, world: int, elastic: Any, **kwargs: Any) -> Any:
    """A quiet ``Trainer(accumulate_grad_batches="auto")`` on the CPU for one setting (``kwargs``: more options)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from elastic_batches.lightning import Trainer

    strategy: Any = {"single": "auto", "ddp": "ddp"}.get(setting)
    if setting.startswith("fsdp2"):
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    return Trainer(
        accumulate_grad_batches="auto",
        callbacks=[elastic],
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _shard(module: Any, parts: tuple[nn.Module, ...]) -> None:
    """``fully_shard`` each of ``parts``, then ``module``, over the strategy's data-parallel mesh (Lightning FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    mesh = module.device_mesh["data_parallel"]
    for part in parts:
        fully_shard(part, mesh=mesh)
    fully_shard(module, mesh=mesh)


def run_lightning_cell(cell: Cell, rank: int = 0, world: int = 1, snapshots: Snapshots | None = None) -> dict:
    """Fit the cell's ``STEPS`` steps with ``Trainer(accumulate_grad_batches="auto")``; what happened."""
    import warnings

    from elastic_batches.lightning import ElasticAccumulation

    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=".*litlogger.*")
    snapshots = snapshots if snapshots is not None else reference()
    rows = GLOBAL_ROWS // world
    module = _lightning_module(cell, rank, rows)
    controllers = {"train": eb.SplitController(split_count=SPLIT)}
    elastic = ElasticAccumulation(controllers=controllers, gather=GATHER.get(cell.setting, "auto"))
    trainer = _trainer(
        cell.setting,
        world,
        elastic,
        max_steps=STEPS,
        max_epochs=1,
        gradient_clip_val=MAX_GRAD_NORM,
        num_sanity_val_steps=0,
    )
    padded = cell.phase == "cut"
    if world == 1:
        loader: Any = torch.utils.data.DataLoader(
            _Rows(padded), batch_sampler=[step_ids(i).tolist() for i in range(STEPS)]
        )
    else:  # Lightning puts in its DistributedSampler, which gives step_ids(step, rank, 2)
        loader = torch.utils.data.DataLoader(_Rows(padded), batch_size=rows)
    if padded:  # Lightning re-creates it with its DistributedSampler, as it does a DataLoader
        loader = eb.MicrobatchingDataLoader(loader, pad_values={"pad": 0.0}, controller=elastic.controllers["train"])
    error = None
    try:
        trainer.fit(module, loader)
    except Exception as err:
        error = _error(err, trainer.global_step)
    module._release()
    fired = module.fired + (module.optimizer.fired if module.optimizer is not None else 0)
    return _result(
        cell,
        trainer.global_step,
        error,
        module,
        snapshots,
        module.ids_checks,
        module.counts,
        fired,
        elastic.controllers["train"],
    )


# -- a setting's cells on the ranks of a RankPool (module-level: pickled to spawned ranks) ------------


def _lightning_environment(rank: int, world: int) -> None:
    """Tell Lightning the processes exist already (as torchrun does), so that it joins the process group."""
    os.environ.update(
        {
            "LOCAL_RANK": str(rank),
            "RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": os.environ.get("MASTER_PORT", "29555"),  # never used: the group is initialized
        }
    )


def run_cells(rank: int, world: int, loop: str, setting: str, only: list[str] | None = None) -> list[dict]:
    """Run every cell of ``loop`` and ``setting`` (or those whose id is in ``only``) on this rank, in order."""
    if loop == "lightning" and world > 1:
        _lightning_environment(rank, world)
    snapshots = reference()
    runner = run_plain_cell if loop == "plain" else run_lightning_cell
    return [runner(cell, rank, world, snapshots) for cell in cells(loop, setting) if only is None or cell.id in only]


# -- what a cell's results must show -----------------------------------------------------------------


def problems(cell: Cell, results: list[dict]) -> list[str]:
    """Everything wrong with a cell's per-rank results; empty when the cell passes."""
    found: list[str] = []
    world = len(results)
    for rank, result in enumerate(results):
        where = f"rank {rank}: " if world > 1 else ""
        expected_fires = 1 if cell.fires_on(rank) else 0
        if result["fired"] != expected_fires:
            found.append(f"{where}the injection fired {result['fired']} times, expected {expected_fires}")
        bad = [(i, c) for i, c in enumerate(result["ids"]) if not c["ok"]]
        for i, c in bad:
            found.append(
                f"{where}step {i}: sample ids lost {c['lost']}, counted twice {c['doubled']}, stray {c['stray']}, "
                f"off by {c['off']:.1e}"
            )
        error = result["error"]
        if cell.recovers:
            if error is not None:
                found.append(f"{where}raised {error['type']}: {error['message']}\n{error['traceback']}")
                continue
            if len(result["ids"]) != STEPS:
                found.append(f"{where}{len(result['ids'])} steps checked, expected {STEPS}")
            if result["weight_error"] > RTOL[cell.setting]:
                found.append(f"{where}relative weight error {result['weight_error']:.2e} > {RTOL[cell.setting]:.0e}")
            count, discarded = expected_outcome(cell, rank, GLOBAL_ROWS // world)
            if result["counts"][OOM_STEP] != count or result["discarded"] != discarded:
                found.append(
                    f"{where}step {OOM_STEP} ran as {result['counts'][OOM_STEP]} microbatches after throwing "
                    f"{result['discarded']} away, expected {count} after {discarded}: the OOM struck elsewhere"
                )
            continue
        failing = [r for r in range(world) if cell.fires_on(r)]
        phase = WHERE[cell.phase] if cell.loop == "plain" or cell.phase == "clip" else LIGHTNING_WHERE
        expected = f"out of memory in {phase} on rank(s) {failing}"
        if error is None:
            found.append(f"{where}no error: an OOM in {phase} must raise ElasticOOMError on every rank")
            continue
        if error["type"] != "ElasticOOMError" or expected not in error["message"]:
            found.append(f"{where}raised {error['type']}: {error['message']!r}; expected ElasticOOMError {expected!r}")
        # No partial update where the OOM struck. The ranks that did not fail learn of it after their own step
        # went through, and keep its update, when it struck in the step itself, or anywhere after the
        # microbatches under Lightning (its clipping runs inside its optimizer step); ElasticStep.optimizer_step
        # agrees on the gradient norm before any rank steps.
        applied = OOM_STEP + int(not cell.fires_on(rank) and cell.phase == "step")
        raised_at = applied if cell.loop == "lightning" else OOM_STEP  # Lightning: trainer.global_step
        if error["step"] != raised_at:
            found.append(f"{where}raised at step {error['step']}, expected {raised_at}")
        if len(result["ids"]) != OOM_STEP + 1:
            found.append(f"{where}{len(result['ids'])} backward passes checked, expected {OOM_STEP + 1}")
        if result["own_weight_errors"][applied] > RTOL[cell.setting]:
            error_ = result["own_weight_errors"][applied]
            found.append(f"{where}weights (own shards) differ from {applied} clean steps by {error_:.2e}")
    return found


def outcome(cell: Cell, results: list[dict]) -> str:
    """A short table entry for the cell: ``recovered, 3→6`` / ``ElasticOOMError on every rank`` / ``FAIL: ...``."""
    found = problems(cell, results)
    if found:
        return "FAIL: " + found[0].splitlines()[0][:80]
    if cell.recovers:
        return f"recovered, {SPLIT}→{results[0]['counts'][OOM_STEP]}"
    kept = [r for r in range(len(results)) if not cell.fires_on(r) and cell.phase == "step"]
    return "ElasticOOMError, every rank" + (f" (rank {kept[0]} had stepped)" if kept else "")


# -- Lightning validation of padded batches ----------------------------------------------------------


def run_lightning_validation(rank: int, world: int, setting: str, fire_rank: int | None) -> dict[str, Any]:
    """``trainer.validate`` on padded batches, with an OOM in the cut of ``fire_rank``'s second microbatch.

    The validation loss is logged with ``sync_dist``: every rank must reach it with the mean over
    the union of the ranks' batches (no hang, nothing lost or counted twice).
    """
    import warnings

    import lightning.pytorch as pl

    from elastic_batches.lightning import ElasticAccumulation

    warnings.filterwarnings("ignore")
    if world > 1:
        _lightning_environment(rank, world)
    model = IdModel()

    class Validated(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.ids = model.net, model.ids

        def configure_model(self) -> None:
            if setting.startswith("fsdp2"):
                _shard(self, (self.net[0], self.net[2], self.ids))

        def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            loss = loss_of((self.net(batch["x"]), self.ids(batch["id"])), batch["y"]) + 0.0 * batch["pad"].sum()
            self.log("val_loss", loss, sync_dist=True)

    controllers = {"validate": eb.SplitController(split_count=SPLIT)}
    elastic = ElasticAccumulation(controllers=controllers, gather=GATHER.get(setting, "auto"))
    trainer = _trainer(setting, world, elastic)
    rows = GLOBAL_ROWS // world
    loader = eb.MicrobatchingDataLoader(
        torch.utils.data.DataLoader(_Rows(padded=True), batch_size=rows),
        pad_values={"pad": 0.0},
        controller=elastic.controllers["validate"],
    )
    with inject_oom_in_cut(calls=1, rank=fire_rank) as oom:
        metrics = trainer.validate(Validated(), loader, verbose=False)
    return {"val_loss": metrics[0]["val_loss"], "fired": oom.fired, "ooms": elastic.controllers["validate"].oom_count}


def validation_reference() -> float:
    """The mean over the validation epoch's batches of each global batch's mean loss (full batches, no split)."""
    model = IdModel()
    x, y = dataset()
    with torch.no_grad():
        losses = [
            float(loss_of(model(x[i : i + GLOBAL_ROWS], torch.arange(i, i + GLOBAL_ROWS)), y[i : i + GLOBAL_ROWS]))
            for i in range(0, SAMPLES, GLOBAL_ROWS)
        ]
    return sum(losses) / len(losses)

"""What a cell of the fault matrix is: its data, model and full-batch reference, and what it must end with."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

import elastic_batches as eb

__all__ = [
    "Cell",
    "EVALUATED",
    "FEATURES",
    "GATHER",
    "GLOBAL_ROWS",
    "ID_TOLERANCE",
    "IdModel",
    "LIGHTNING_PHASES",
    "LOOP_SETTINGS",
    "LIGHTNING_WHERE",
    "LOOPS",
    "LR",
    "MAX_GRAD_NORM",
    "MICROBATCH_PHASES",
    "OOM_STEP",
    "OVERLAPPED",
    "OVERLAP_BUCKET_BYTES",
    "PHASES",
    "POSITIONS",
    "RECOVERING_PHASES",
    "RTOL",
    "SAMPLES",
    "SCRIPTED",
    "SCRIPTED_SETTINGS",
    "SETTINGS",
    "SPLIT",
    "STEPS",
    "WHERE",
    "WIDTH",
    "batch",
    "cells",
    "dataset",
    "expected_outcome",
    "flat",
    "loss_of",
    "oom_call",
    "pad_length",
    "padded_batch",
    "padded_loss",
    "predicted_counts",
    "reference",
    "relative_error",
    "step_ids",
]

SAMPLES = 72  # ids 0..71: STEPS batches of GLOBAL_ROWS, each sample used once
GLOBAL_ROWS = 24  # rows per step over all ranks
STEPS = 3
OOM_STEP = 1  # the step the OOM is injected in (step 0 settles the count first)
SPLIT = 3  # microbatches at the start
FEATURES = 6
WIDTH = 16
LR = 0.1
MAX_GRAD_NORM = 0.25  # every cell clips (the reference with torch's clip_grad_norm_)
RTOL = {  # float32, relative
    "single": 1e-6, "ddp": 1e-5, "ddp-overlap": 1e-5, "fsdp2": 1e-5, "fsdp2-module": 1e-5, "fsdp2-script": 1e-5,
    "fsdp2-eval": 1e-5,
}  # fmt: skip
ID_TOLERANCE = 1e-4  # |gradient x GLOBAL_ROWS - round(...)| per embedding row

LOOPS = ("plain", "lightning")
SETTINGS = ("single", "ddp", "fsdp2", "fsdp2-module")
# Per module, step OOM_STEP's first attempt following a script (two warm-up attempts agreed on it): plain loop only.
SCRIPTED = "fsdp2-script"
# The same, with a validation (step.evaluate, then a bare no_grad forward) between step 0 and step OOM_STEP.
EVALUATED = "fsdp2-eval"
SCRIPTED_SETTINGS = (SCRIPTED, EVALUATED)
# DDP with buckets small enough that the last microbatch's backward starts three of the model's four (the fourth
# carries the vote); its cells add an OOM in the hook that starts the first, middle or last of those three.
OVERLAPPED = "ddp-overlap"
OVERLAP_BUCKET_BYTES = 256
LOOP_SETTINGS = {"plain": (*SETTINGS, SCRIPTED, EVALUATED, OVERLAPPED), "lightning": SETTINGS}
GATHER = {"fsdp2-module": "module", SCRIPTED: "module", EVALUATED: "module"}  # gather= per setting; else "auto"
PHASES = ("transfer", "cut", "count", "forward", "backward", "sum", "clip", "step")
MICROBATCH_PHASES = ("transfer", "cut", "count", "forward", "backward")  # struck at a chosen microbatch
# "bucket" (OVERLAPPED only): in the last microbatch's backward, starting the first, middle or last scheduled bucket
RECOVERING_PHASES = (*MICROBATCH_PHASES, "bucket", "sum")  # between the start of an attempt and the vote
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
    phases: tuple[str, ...] = PHASES if loop == "plain" else LIGHTNING_PHASES
    if setting == OVERLAPPED:
        phases = (*phases[: phases.index("sum")], "bucket", *phases[phases.index("sum") :])
    out: list[Cell] = []
    for phase in phases:
        for position in POSITIONS if phase in (*MICROBATCH_PHASES, "bucket") else (None,):
            out.extend(Cell(loop, setting, phase, position, ranks) for ranks in rank_variants)
    return out


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (SAMPLES, FEATURES) and ``y`` (SAMPLES, 1); sample ``i`` has id ``i``."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return x, x[:, :1].sin() + 0.1 * torch.randn(SAMPLES, 1, generator=generator)


def _shards() -> list[list[int]]:
    """Each of 2 ranks' sample ids in order: Lightning's ``DistributedSampler`` (shuffled, seed 0, epoch 0)."""
    from torch.utils.data import DistributedSampler

    ids: Any = range(SAMPLES)  # a sampler only takes the length of what it samples
    return [list(DistributedSampler(ids, num_replicas=2, rank=r, shuffle=True, seed=0)) for r in range(2)]


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
        return third, _discarded_by_failing(cell, first) + _discarded_by_peer(cell, retry, retry=True)
    return third, _discarded_by_peer(cell, first) + _discarded_by_failing(cell, retry)


def _guarded(cell: Cell, retry: bool) -> bool:
    """Whether FSDP2's collectives are guarded one by one in that attempt of step ``OOM_STEP``.

    Per module; scripted, the first attempt follows its script and the retry (another count) does not.
    """
    return cell.setting == "fsdp2-module" or (cell.setting in SCRIPTED_SETTINGS and retry)


def _discarded_by_peer(cell: Cell, count: int, retry: bool = False) -> int:
    """The microbatches a rank throws away in an attempt of ``count`` microbatches in which its peer fails.

    All of them, except where FSDP2's collectives are guarded one by one: the rank stops at its
    first collective after the peer's failure, in the microbatch it fails in (``count_fn``: in
    the first one, after counting every microbatch), having started it. (Following a script, the
    failed rank stands in for its collectives: its peer runs the whole attempt.)
    """
    if not _guarded(cell, retry) or cell.phase == "sum":
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
    if cell.phase in ("sum", "bucket"):  # the losses are summed after the last microbatch; a bucket starts in it
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
    if cell.phase in ("sum", "bucket"):  # one sum an attempt; each bucket starts once, in the last microbatch
        return int(second)
    assert cell.position is not None
    first, retry, _ = predicted_counts(rows)
    if second:
        return _calls_before_peer_failed(cell, first) + _position(cell.position, retry)
    return _position(cell.position, first)


def _calls_before_peer_failed(cell: Cell, count: int) -> int:
    """The calls (of the cell's phase) a rank makes in an attempt of ``count`` microbatches in which its peer fails.

    All of them, except where FSDP2's collectives are guarded one by one (the first attempt, per
    module): the rank stops in the microbatch its peer fails in, after that microbatch's call
    (``count_fn``: after every microbatch's, which come first).
    """
    if not _guarded(cell, retry=False) or cell.phase == "count":
        return count
    assert cell.position is not None
    return _position(cell.position, count) + 1

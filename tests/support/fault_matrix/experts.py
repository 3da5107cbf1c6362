"""The fault matrix's mixture-of-experts cells: ranks whose rows go to different experts, per module and gathered once.

A model of a shared layer and two experts, each an FSDP2 unit, on two gloo ranks; each row goes
to the expert its route names, and an expert with no row in a microbatch is skipped (as
mixture-of-experts layers do). Its cells:

* routing ``"shared"``: every rank's rows alternate between the experts, so every microbatch of
  every rank runs both; per module (``gather="module"``), an OOM in the shared layer's forward of
  microbatch 1 on rank 0, rank 1 or neither, guarded or in a scripted attempt: recovered, weights
  equal to plain full-batch training (``RTOL``);
* routing ``"per-rank"``: rank ``r``'s rows all go to expert ``r``, the experts of equal or of
  different sizes. Per module the ranks would pair one expert's collectives with the other's
  (equal sizes: a silently wrong gradient): every rank raises ``RuntimeError`` naming both
  experts' units instead, guarded (the first step) or scripted (after two steps that agreed on
  a script), no gradient reduced. Gathered once (``gather="auto"``, which this model fits) it
  trains exactly, with an OOM on rank 0, rank 1 or neither.
"""

from __future__ import annotations

import dataclasses
import re
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import elastic_batches as eb
from elastic_batches.testing.injection import inject_oom

from support.fault_matrix.cells import LR, RTOL, SPLIT, STEPS, flat, relative_error

__all__ = ["ExpertCell", "Experts", "expert_cells", "expert_outcome", "expert_problems", "run_expert_cells"]

ROWS = 12  # per rank and step
SIZES = {"equal": (16, 16), "different": (16, 24)}  # the experts' hidden widths
NAMED = r"unit \d \('(experts\.\d)'\)"  # how the error names an expert's unit


@dataclasses.dataclass(frozen=True)
class ExpertCell:
    """One mixture-of-experts cell (see the module docstring)."""

    routing: str  # "shared" or "per-rank"
    sizes: str  # a key of SIZES
    gather: str  # ElasticStep's gather=
    scripted: bool  # the step that matters follows a script (two agreeing steps before it)
    oom: str  # the rank that runs out of memory: "0", "1" or "none"

    @property
    def id(self) -> str:
        parts = ["moe", self.routing, f"{self.sizes}-experts", f"gather-{self.gather}"]
        parts += ["scripted"] if self.scripted else []
        return "-".join([*parts, "no-oom" if self.oom == "none" else f"oom-rank{self.oom}"])

    @property
    def raises(self) -> bool:
        """Whether every rank must raise: ranks running different experts, per module."""
        return self.routing == "per-rank" and self.gather == "module"

    @property
    def oom_step(self) -> int:
        return 2 if self.scripted else 0


def expert_cells() -> list[ExpertCell]:
    """Every mixture-of-experts cell, in table order."""
    out = [ExpertCell("shared", "equal", "module", s, oom) for s in (False, True) for oom in ("none", "0", "1")]
    out += [ExpertCell("per-rank", sizes, "module", s, "none") for sizes in SIZES for s in (False, True)]
    out += [ExpertCell("per-rank", sizes, "auto", False, oom) for sizes in SIZES for oom in ("none", "0", "1")]
    return out


class Experts(nn.Module):
    """A shared layer, then two experts; each row goes to the expert its route names, one with no row is skipped."""

    def __init__(self, sizes: tuple[int, int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(6, 8)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(8, h), nn.Tanh(), nn.Linear(h, 1)) for h in sizes)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(x))
        out = torch.zeros(len(x), 1)
        for index, expert in enumerate(self.experts):
            rows = (route == index).nonzero().squeeze(1)
            if len(rows):
                out = out.index_put((rows,), expert(h[rows]))
        return out


def _batch(cell: ExpertCell, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(ROWS, 6, generator=generator)
    per_rank = cell.routing == "per-rank" and (not cell.scripted or step >= cell.oom_step)
    route = torch.full((ROWS,), rank % 2) if per_rank else torch.arange(ROWS) % 2
    return x, x[:, :1].sin(), route


def _run(cell: ExpertCell, rank: int, world: int, mesh: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    model = Experts(SIZES[cell.sizes])
    for part in (model.shared, *model.experts):
        fully_shard(part, mesh=mesh)
    fully_shard(model, mesh=mesh)
    plain = Experts(SIZES[cell.sizes])
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=SPLIT), gather=cell.gather)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    reference = torch.optim.SGD(plain.parameters(), lr=LR)
    error: dict[str, Any] | None = None
    fired = 0
    for i in range(STEPS):
        armed = i == cell.oom_step and cell.oom == str(rank)
        optimizer.zero_grad(set_to_none=True)
        with inject_oom(model.shared, phase="forward", calls=[1] if armed else [10**6]) as oom:
            try:
                step.backward(_batch(cell, i, rank), lambda mb: nn.functional.mse_loss(model(mb[0], mb[2]), mb[1]))
            except Exception as err:  # every rank must get here alike; the check says whether it should have
                error = {"type": type(err).__name__, "message": str(err), "step": i, "trace": traceback.format_exc()}
        fired += oom.fired
        if error is not None:
            break
        optimizer.step()
        x, y, route = (torch.cat(parts) for parts in zip(*(_batch(cell, i, r) for r in range(world)), strict=True))
        reference.zero_grad(set_to_none=True)
        nn.functional.mse_loss(plain(x, route), y).backward()
        reference.step()
    sync = getattr(step.sync, "active", step.sync)
    guard = getattr(sync, "guard", None)
    weights = relative_error(flat(model.parameters()), flat(plain.parameters())) if error is None else None
    return {
        "cell": cell.id,
        "error": error,
        "fired": fired,
        "ooms": step.controller.oom_count,
        "untouched": error is not None and all(p.grad is None for p in model.parameters()),
        "weight_error": weights,
        "stood_in": guard.stood_in if guard is not None else 0,
    }


def run_expert_cells(rank: int, world: int, only: list[str] | None = None) -> list[dict[str, Any]]:
    """Run every mixture-of-experts cell (or those whose id is in ``only``) on this rank, in order (a job)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    results = [_run(cell, rank, world, mesh) for cell in expert_cells() if only is None or cell.id in only]
    dist.barrier()  # every rank finished every cell: none waits in a collective
    return results


def expert_problems(cell: ExpertCell, results: list[dict[str, Any]]) -> list[str]:
    """Everything wrong with a mixture-of-experts cell's per-rank results; empty when it passes."""
    found: list[str] = []
    for rank, result in enumerate(results):
        where = f"rank {rank}: "
        error = result["error"]
        if cell.raises:
            named = sorted(re.findall(NAMED, error["message"])) if error is not None else []
            if error is None or error["type"] != "RuntimeError" or named != ["experts.0", "experts.1"]:
                found.append(f"{where}expected RuntimeError naming both experts' units, got {error}")
            elif error["step"] != cell.oom_step or not result["untouched"]:
                found.append(f"{where}raised at step {error['step']} (expected {cell.oom_step}), gradients reduced")
            continue
        if error is not None:
            found.append(f"{where}raised {error['type']}: {error['message']}\n{error['trace']}")
            continue
        if result["weight_error"] > RTOL["fsdp2-module"]:
            found.append(f"{where}relative weight error {result['weight_error']:.2e}")
        if result["fired"] != int(cell.oom == str(rank)) or result["ooms"] != int(cell.oom != "none"):
            found.append(f"{where}fired {result['fired']}, learned {result['ooms']} OOMs")
        stands_in = cell.scripted and cell.oom == str(rank)  # a scripted attempt's failed rank stands in
        if cell.gather == "module" and (result["stood_in"] > 0) != stands_in:
            found.append(f"{where}stood in for {result['stood_in']} collectives, expected {stands_in}")
    return found


def expert_outcome(cell: ExpertCell, results: list[dict[str, Any]]) -> str:
    """A short table entry: ``recovered, exact`` / ``exact`` / ``RuntimeError naming both experts`` / ``FAIL: ...``."""
    found = expert_problems(cell, results)
    if found:
        return "FAIL: " + found[0].splitlines()[0][:80]
    if cell.raises:
        return "RuntimeError on every rank, naming both experts' units"
    return "recovered, exact" if cell.oom != "none" else "exact"

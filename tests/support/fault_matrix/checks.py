"""Judging a cell's per-rank results: weights against the reference, every sample counted once, the error raised."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from support.fault_matrix.cells import (
    GLOBAL_ROWS,
    ID_TOLERANCE,
    LIGHTNING_WHERE,
    OOM_STEP,
    RTOL,
    SAMPLES,
    SCRIPTED_SETTINGS,
    SPLIT,
    STEPS,
    WHERE,
    Cell,
    Snapshots,
    expected_outcome,
    flat,
    relative_error,
    step_ids,
)

__all__ = ["id_check", "outcome", "problems", "weight_errors"]


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
            if cell.setting in SCRIPTED_SETTINGS:  # the rank that failed the scripted attempt stood in for them
                first = 0 if cell.ranks == "both" else int(cell.ranks)
                stands_in = rank == first and cell.phase != "sum"  # the losses are summed after the last one
                if (result["stood_in"] > 0) != stands_in:
                    found.append(
                        f"{where}stood in for {result['stood_in']} collectives, "
                        f"expected {'some' if stands_in else 'none'}"
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

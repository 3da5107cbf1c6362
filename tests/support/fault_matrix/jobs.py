"""A setting's cells, run one after the other on one rank (module level: it is pickled to spawned ranks)."""

from __future__ import annotations

from support.fault_matrix.cells import cells, reference
from support.fault_matrix.lightning import lightning_environment, run_lightning_cell
from support.fault_matrix.plain import run_plain_cell

__all__ = ["run_cells"]


def run_cells(rank: int, world: int, loop: str, setting: str, only: list[str] | None = None) -> list[dict]:
    """Run every cell of ``loop`` and ``setting`` (or those whose id is in ``only``) on this rank, in order."""
    if loop == "lightning" and world > 1:
        lightning_environment(rank, world)
    snapshots = reference()
    runner = run_plain_cell if loop == "plain" else run_lightning_cell
    return [runner(cell, rank, world, snapshots) for cell in cells(loop, setting) if only is None or cell.id in only]

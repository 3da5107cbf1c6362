"""The fault-injection matrix: an OOM in every phase, at every microbatch, on every rank.

Each cell (``support.fault_matrix`` defines them and what they must show) trains a tiny model
whose per-sample embedding counts how often each sample entered each step's gradient. A cell
passes when its injection struck exactly where it was aimed (the microbatches thrown away and
the split count the step ends with say so) and then either the run recovered, with weights
equal to plain full-batch training within ``RTOL`` (1e-6 relative in one process, 1e-5 on two
ranks, float32) and every sample counted exactly once in every step — for an OOM anywhere between
the start of an attempt and the ranks' vote: the transfer, the cut of a padded microbatch,
``count_fn``, the forward, the backward, the sum of the losses — or, in the clipping and the
optimizer step, every rank raised ``ElasticOOMError`` naming where and which ranks.

One process: every cell runs here. DDP and FSDP2: all cells of one loop and setting run in one
job on two spawned gloo ranks (``support.ranks.RankPool``), under a deadline after which
the ranks are killed and every cell of the job fails with their stacks: a hang is a failure,
never a frozen suite. ``python benchmarks/fault_matrix.py`` prints the same cells as a table.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from support.fault_matrix import (
    GLOBAL_ROWS,
    LOOP_SETTINGS,
    LOOPS,
    OOM_STEP,
    OVERLAPPED,
    RTOL,
    SAMPLES,
    SETTINGS,
    Cell,
    ExpertCell,
    cells,
    expert_cells,
    expert_problems,
    flat,
    id_check,
    problems,
    reference,
    relative_error,
    run_cells,
    run_expert_cells,
    run_lightning_cell,
    run_lightning_validation,
    run_plain_cell,
    step_ids,
    validation_reference,
)
from support.ranks import RankFailure, RankPool

DEADLINE_S = 120  # one job: every cell of a loop and setting (about 3-7 s when nothing hangs)
ALL_CELLS = [cell for loop in LOOPS for setting in LOOP_SETTINGS[loop] for cell in cells(loop, setting)]


class _Jobs:
    """Runs each distributed (loop, setting) job once, on first use; remembers its results or its failure."""

    def __init__(self, pool: RankPool) -> None:
        self.pool = pool
        self.done: dict[tuple[str, str], list[list[dict]] | RankFailure] = {}

    def results(self, cell: Cell) -> list[dict[str, Any]]:
        key = (cell.loop, cell.setting)
        if key not in self.done:
            try:
                self.done[key] = self.pool.run(run_cells, cell.loop, cell.setting, timeout=DEADLINE_S)
            except RankFailure as failure:
                self.done[key] = failure
        job = self.done[key]
        if isinstance(job, RankFailure):
            pytest.fail(f"the {cell.loop} {cell.setting} job failed (every cell of it fails with it):\n{job}")
        index = [c.id for c in cells(*key)].index(cell.id)
        return [per_rank[index] for per_rank in job]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Jobs]:
    pool = RankPool(tmp_path_factory.mktemp("fault-matrix"), world_size=2)
    yield _Jobs(pool)
    pool.close()


@pytest.fixture(scope="module")
def snapshots() -> list[list[torch.Tensor]]:
    return reference()


@pytest.mark.parametrize("cell", ALL_CELLS, ids=[cell.id for cell in ALL_CELLS])
def test_cell(cell: Cell, jobs: _Jobs, snapshots: list[list[torch.Tensor]]) -> None:
    if cell.setting == "single":
        runner = run_plain_cell if cell.loop == "plain" else run_lightning_cell
        results = [runner(cell, 0, 1, snapshots)]
    else:
        results = jobs.results(cell)
    found = problems(cell, results)
    assert not found, f"{cell.id}:\n" + "\n".join(found)


# -- the instruments themselves ----------------------------------------------------------------


def test_the_id_check_sees_a_lost_a_doubled_and_a_stray_sample() -> None:
    ids = step_ids(OOM_STEP)
    grad = torch.zeros(SAMPLES)
    grad[ids] = 1.0 / GLOBAL_ROWS
    assert id_check(grad, OOM_STEP)["ok"]
    unused = next(i for i in range(SAMPLES) if i not in set(ids.tolist()))
    grad[ids[0]] = 0.0  # lost
    grad[ids[1]] = 2.0 / GLOBAL_ROWS  # counted twice
    grad[unused] = 1.0 / GLOBAL_ROWS  # from another step
    check = id_check(grad, OOM_STEP)
    assert (check["ok"], check["lost"], check["doubled"], check["stray"]) == (False, 1, 1, 1)


def test_the_weight_check_tells_one_step_from_another(snapshots: list[list[torch.Tensor]]) -> None:
    # "no partial update" and "recovered" mean something only if one step moves the weights well past RTOL
    for before, after in zip(snapshots, snapshots[1:], strict=False):
        assert relative_error(flat(after), flat(before)) > 100 * max(RTOL.values())


def test_every_rank_variant_and_position_is_in_the_matrix() -> None:
    distributed = [c for c in ALL_CELLS if c.setting != "single"]
    assert {c.ranks for c in distributed} == {"0", "1", "both"}
    for loop in LOOPS:
        for setting in LOOP_SETTINGS[loop]:
            positions = {(c.phase, c.position) for c in cells(loop, setting) if c.position is not None}
            phases = (
                ("transfer", "cut", "count", "forward", "backward")
                if loop == "plain"
                else ("cut", "forward", "backward")
            )
            if setting == OVERLAPPED:  # the bucket of the last microbatch's schedule that the OOM strikes
                phases = (*phases, "bucket")
            assert positions == {(p, q) for p in phases for q in ("first", "middle", "last")}


# -- Lightning validation: an OOM in the cut of a padded validation batch ------------------------


@pytest.mark.parametrize("setting", SETTINGS)
def test_lightning_validation_of_padded_batches_retries_an_oom_in_the_cut_on_one_rank(
    setting: str, jobs: _Jobs
) -> None:
    if setting == "single":
        results = [run_lightning_validation(0, 1, setting, 0)]
    else:
        results = jobs.pool.run(run_lightning_validation, setting, 1, timeout=DEADLINE_S)
    expected = validation_reference()
    for rank, result in enumerate(results):
        assert result["fired"] == (1 if setting == "single" or rank == 1 else 0), f"rank {rank}"
        assert result["ooms"] == 1, f"rank {rank}: every rank learned of the OOM"
        assert abs(result["val_loss"] - expected) <= 1e-6 * abs(expected), f"rank {rank}: {result['val_loss']}"


# -- mixture of experts: ranks whose rows go to different experts -------------------------------------

EXPERT_CELLS = expert_cells()


@pytest.fixture(scope="module")
def expert_results(jobs: _Jobs) -> list[list[dict[str, Any]]] | RankFailure:
    try:
        return jobs.pool.run(run_expert_cells, timeout=DEADLINE_S)
    except RankFailure as failure:
        return failure


@pytest.mark.parametrize("cell", EXPERT_CELLS, ids=[cell.id for cell in EXPERT_CELLS])
def test_expert_cell(cell: ExpertCell, expert_results: list[list[dict[str, Any]]] | RankFailure) -> None:
    if isinstance(expert_results, RankFailure):
        pytest.fail(f"the mixture-of-experts job failed (every cell of it fails with it):\n{expert_results}")
    index = [c.id for c in EXPERT_CELLS].index(cell.id)
    found = expert_problems(cell, [per_rank[index] for per_rank in expert_results])
    assert not found, f"{cell.id}:\n" + "\n".join(found)

"""The fault-injection matrix of ``docs/reliability.md``: where an OOM strikes, and what follows.

Runs every cell of ``support.fault_matrix`` (the cells ``tests/test_fault_matrix.py``
asserts): the one-process cells here, the DDP and FSDP2 cells as one job per loop and setting on
two gloo ranks under a deadline (``support.ranks.RankPool``). Prints one markdown table per loop
(rows: where the OOM struck; columns: setting and ranks), a summary of the checks per job, and
one JSON line per cell. Exits 1 if any cell fails.

    python benchmarks/fault_matrix.py            # the matrix (minutes on 2 CPU cores; quick: about one)
    python benchmarks/fault_matrix.py --leaks    # also the leak and changing-memory figures

With ``ELASTIC_BATCHES_BENCH_QUICK=1`` (``bench --quick``) only the one-process, DDP rank 1 and (in
the plain loop) FSDP2 per module rank 1 columns run; the others read "not run (quick)".

``--leaks`` runs the procedures ``tests/test_reliability.py`` asserts bounds on
(``support.fault_matrix.churn``) and prints what they measure: 200 OOM-and-retry
cycles, memory that shrinks and grows back.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PYTHONWARNINGS", "ignore")  # the spawned ranks inherit it: Lightning's tips stay quiet
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # support: the harness; ranks inherit it

DEADLINE_S = 180
QUICK = os.environ.get("ELASTIC_BATCHES_BENCH_QUICK", "") not in ("", "0")
# ELASTIC_BATCHES_BENCH_QUICK=1: one column per scheme, FSDP2's in the plain loop only, and of two ranks the OOM
# on rank 1 alone (the suite's tests/test_fault_matrix.py runs every cell)
QUICK_SETTINGS = {"plain": ("single", "ddp", "fsdp2-module"), "lightning": ("single", "ddp")}


def run_settings(fm: Any, loop: str) -> tuple[str, ...]:
    """The settings of ``loop`` this run covers: all, or under QUICK one per scheme."""
    return tuple(s for s in fm.LOOP_SETTINGS[loop] if not QUICK or s in QUICK_SETTINGS[loop])


def run_cells(fm: Any, loop: str, setting: str) -> list[Any]:
    """The cells of ``loop`` and ``setting`` this run covers: all, or under QUICK those of an OOM on rank 1 alone."""
    cells = fm.cells(loop, setting)
    return cells if not QUICK or setting == "single" else [c for c in cells if c.ranks == "1"]


COLUMNS = [("single", "0", "one process")] + [
    (setting, ranks, f"{name} {label}")
    for setting, name in (
        ("ddp", "DDP"),
        ("fsdp2", "FSDP2"),
        ("fsdp2-module", "FSDP2 per module"),
        ("fsdp2-script", "FSDP2 per module, scripted"),
        ("fsdp2-eval", "FSDP2 per module, scripted, validated between steps"),
        ("ddp-overlap", "DDP, last microbatch overlapped"),
    )
    for ranks, label in (("0", "rank 0"), ("1", "rank 1"), ("both", "both ranks"))
]
HEADINGS = {
    "plain": "Plain loop: `ElasticStep.backward` + `ElasticStep.optimizer_step(optimizer, max_grad_norm=0.25)`",
    "lightning": 'Lightning: `Trainer(accumulate_grad_batches="auto", gradient_clip_val=0.25)`',
}
PHASE_NAMES = {
    "transfer": "device transfer",
    "cut": "cut (padded microbatch)",
    "count": "`count_fn`",
    "sum": "sum of the losses",
    "forward": "forward",
    "backward": "backward (first layer)",
    "bucket": "bucket start (DDP's last backward; row: which of its buckets)",
    "hook": "`on_before_optimizer_step`",
    "clip": "gradient norm (clipping)",
    "step": "`optimizer.step()`",
}


def run_matrix() -> dict[str, list[dict[str, Any]]]:
    """Every cell's per-rank results, by cell id."""
    import logging
    import warnings

    import support.fault_matrix as fm
    from support.ranks import RankFailure, RankPool

    warnings.filterwarnings("ignore")
    import lightning.pytorch  # noqa: F401 - its import sets its logger's level: quiet it after, not before

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    results: dict[str, list[dict[str, Any]]] = {}
    snapshots = fm.reference()
    with tempfile.TemporaryDirectory() as workdir:
        pool = RankPool(Path(workdir), world_size=2)
        try:
            for loop in fm.LOOPS:
                for setting in run_settings(fm, loop):
                    start = time.perf_counter()
                    cells = run_cells(fm, loop, setting)
                    if setting == "single":
                        runner = fm.run_plain_cell if loop == "plain" else fm.run_lightning_cell
                        for cell in cells:
                            results[cell.id] = [runner(cell, 0, 1, snapshots)]
                    else:
                        try:
                            only = [c.id for c in cells] if QUICK else None
                            per_rank = pool.run(fm.run_cells, loop, setting, only, timeout=DEADLINE_S)
                        except RankFailure as failure:
                            print(f"{loop} {setting}: the job failed\n{failure}", file=sys.stderr)
                            per_rank = None
                        for index, cell in enumerate(cells):
                            results[cell.id] = [] if per_rank is None else [rank[index] for rank in per_rank]
                    seconds = time.perf_counter() - start
                    print(f"ran {loop} {setting}: {len(cells)} cells in {seconds:.1f} s", flush=True)
            try:  # the mixture-of-experts cells: one job
                per_rank = pool.run(fm.run_expert_cells, timeout=DEADLINE_S)
            except RankFailure as failure:
                print(f"mixture of experts: the job failed\n{failure}", file=sys.stderr)
                per_rank = None
            for index, expert in enumerate(fm.expert_cells()):
                results[expert.id] = [] if per_rank is None else [rank[index] for rank in per_rank]
        finally:
            pool.close()
    return results


def entry(cell: Any, results: list[dict[str, Any]]) -> str:
    import support.fault_matrix as fm

    if not results:
        return "FAIL: hang or crash (deadline)"
    return fm.outcome(cell, results)


def print_tables(results: dict[str, list[dict[str, Any]]]) -> int:
    """The markdown tables, a summary of the checks, JSON lines; the number of failing cells."""
    import support.fault_matrix as fm

    failures = 0
    for loop in fm.LOOPS:
        by_key = {
            (c.setting, c.ranks, c.phase, c.position): c for s in fm.LOOP_SETTINGS[loop] for c in fm.cells(loop, s)
        }
        covered = run_settings(fm, loop)
        rows = []
        widest = fm.OVERLAPPED if fm.OVERLAPPED in fm.LOOP_SETTINGS[loop] else "single"  # it adds the bucket rows
        for c in fm.cells(loop, widest):
            rows.append((c.phase, c.position))
        print(f"\n#### {HEADINGS[loop]}\n")
        print("| OOM in | microbatch | " + " | ".join(label for _, _, label in COLUMNS) + " |")
        print("|---|---|" + "---|" * len(COLUMNS))
        for phase, position in rows:
            texts = []
            for setting, ranks, _ in COLUMNS:
                cell = by_key.get((setting, ranks, phase, position))
                if cell is None:
                    texts.append("n/a")
                else:
                    texts.append(entry(cell, results[cell.id]) if cell.id in results else "not run (quick)")
            print(f"| {PHASE_NAMES[phase]} | {position or '—'} | " + " | ".join(texts) + " |")
        print()
        for setting in covered:
            cells = run_cells(fm, loop, setting)
            runs = [r for c in cells for r in results[c.id]]
            if not runs:
                print(f"- {setting}: no results (the job failed)")
                failures += len(cells)
                continue
            recovered = [r for c in cells for r in results[c.id] if c.recovers]
            worst = max((r["weight_error"] for r in recovered), default=0.0)
            checks = sum(len(r["ids"]) for r in runs)
            bad = sum(1 for r in runs for check in r["ids"] if not check["ok"])
            off = max((check["off"] for r in runs for check in r["ids"]), default=0.0)
            print(
                f"- {loop}, {setting}: {len(cells)} cells; largest relative weight error after recovery "
                f"{worst:.1e} (tolerance {fm.RTOL[setting]:.0e}); {checks} per-rank step gradients checked over "
                f"all {fm.SAMPLES} sample ids, {bad} with a sample lost, doubled or stray (largest deviation "
                f"from a whole count {off:.1e})"
            )
    print("\n#### Mixture of experts (per module and gathered once; `support.fault_matrix.experts`)\n")
    print("| routing | experts | gather | step | OOM | outcome |")
    print("|---|---|---|---|---|---|")
    for expert in fm.expert_cells():
        runs = results[expert.id]
        found = fm.expert_problems(expert, runs) if runs else ["hang or crash"]
        failures += bool(found)
        text = fm.expert_outcome(expert, runs) if runs else "FAIL: hang or crash (deadline)"
        oom = "none" if expert.oom == "none" else f"rank {expert.oom}, shared layer's forward, microbatch 1"
        step = "scripted" if expert.scripted else "guarded" if expert.gather == "module" else "gathered once"
        print(f"| {expert.routing} | {expert.sizes} sizes | {expert.gather} | {step} | {oom} | {text} |")
    for loop in fm.LOOPS:
        for setting in run_settings(fm, loop):
            for cell in run_cells(fm, loop, setting):
                runs = results[cell.id]
                found = fm.problems(cell, runs) if runs else ["hang or crash"]
                failures += bool(found)
                record = {
                    "benchmark": "fault_matrix",
                    "cell": cell.id,
                    "outcome": entry(cell, runs),
                    "ok": not found,
                    "weight_error": max((r["weight_error"] for r in runs), default=None),
                    "errors": [r["error"]["message"][:160] if r["error"] else None for r in runs],
                }
                print(json.dumps(record))
    return failures


def print_leaks() -> None:
    """The figures behind tests/test_reliability.py, measured with the procedures it asserts bounds on."""
    from support.fault_matrix import churn

    cycles = churn.oom_retry_cycles(cycles=200)
    print("\n#### 200 OOM-and-retry cycles (MLP 16-256-1, batch 64, budget between 1 and 2 microbatches)\n")
    print("| measure | change over 200 cycles |")
    print("|---|---|")
    print(f"| OOMs raised by the budget | {cycles['ooms']} |")
    print(f"| live tensors (gc) | {cycles['tensors']:+d} |")
    print(f"| OutOfMemoryError objects alive | {cycles['oom_errors']:+d} |")
    print(f"| simulated device bytes live after the cycles | {cycles['live_bytes']} |")
    print(f"| resident memory of the process | {cycles['resident_bytes'] / 2**20:+.2f} MiB |")
    print(f"| sizes held by the controller for error messages | {cycles['tried']} |")
    print(f"\n({cycles['seconds_per_cycle'] * 1000:.1f} ms per cycle of one retried and one whole step)")

    shrinking = churn.shrinking_memory()
    print("\n#### Memory that shrinks (4 levels x 6 batches of 48 rows)\n")
    print(f"- split count settled at each level: {shrinking['settled']}; OOMs per level: {shrinking['ooms']}")
    print(
        f"- {shrinking['batches']} batches, none lost; largest relative gradient error vs the whole batch "
        f"{shrinking['gradient_error']:.1e}"
    )

    growing = churn.growing_memory(grow_after=10)
    print("\n#### Memory that grows back (grow_after=10, 48 rows)\n")
    print(
        f"- settled at {growing['settled']} microbatches; 50 more tight steps: {growing['probe_ooms']} failed growth "
        f"probes ({growing['probe_ooms'] * 20} per 1000 steps, the back-off doubling the wait after each)"
    )
    print(f"- memory freed: {growing['freed']} microbatch(es) after 60 steps, {growing['freed_ooms']} OOMs on the way")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaks", action="store_true", help="also print the leak and changing-memory figures")
    args = parser.parse_args()
    start = time.perf_counter()
    failures = print_tables(run_matrix())
    print(f"\n{failures} failing cell(s); {time.perf_counter() - start:.0f} s")
    if args.leaks:
        print_leaks()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

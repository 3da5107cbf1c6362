"""Lightning's own tests, with ``Trainer`` replaced by ``Trainer(accumulate_grad_batches="auto")`` of this package.

Lightning's tests are not in this repository and this script fetches nothing: give it a checkout
of them (the ``tests/`` folder of Lightning-AI/pytorch-lightning at the tag of the installed
Lightning, e.g. ``git archive 2.6.5 tests | tar -x -C /tmp/pl``), with ``--tests /tmp/pl/tests``
or ``ELASTIC_BATCHES_LIGHTNING_TESTS``. Variants, one per run:

* ``plain``: Lightning's tests as they are (the reference: only what passes here counts);
* ``auto``: ``lightning.pytorch.Trainer`` is a subclass of ``elastic_batches.lightning.Trainer``
  that turns ``accumulate_grad_batches=1`` (or unset) into ``"auto"``; another int stays
  Lightning's own accumulation;
* ``split2``: the same, with every stage's controller starting at ``split_count=2``, so that
  every batch that can be cut runs as two microbatches.

Each run writes one JSON line per test (outcome, the exception's class and first line, and in
the elastic variants how many batches of each stage ran split) to ``OUT/VARIANT.jsonl``;
``compare`` reads them and prints the counts, then every test that passes plain but not in a
variant, grouped by the reason its message gives (JSON lines too)::

    nice -n 10 python benchmarks/lightning_suite.py run --tests /tmp/pl/tests --variant plain --out /tmp/suite
    nice -n 10 python benchmarks/lightning_suite.py run --tests /tmp/pl/tests --variant auto --out /tmp/suite
    nice -n 10 python benchmarks/lightning_suite.py run --tests /tmp/pl/tests --variant split2 --out /tmp/suite
    python benchmarks/lightning_suite.py compare /tmp/suite

Without a checkout (``python -m elastic_batches bench``) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

VARIANTS = ("plain", "auto", "split2")
# What the integration touches: Lightning's loops, optimization, logging, flags, checkpoints, hooks, callbacks, core.
SUITE = (
    "tests_pytorch/loops",
    "tests_pytorch/trainer/optimization",
    "tests_pytorch/trainer/logging_",
    "tests_pytorch/trainer/flags",
    "tests_pytorch/checkpointing",
    "tests_pytorch/models/test_hooks.py",
    "tests_pytorch/callbacks",
    "tests_pytorch/core",
)
# Checkpoints of past Lightning versions, downloaded by Lightning's CI: absent from a checkout of the tests.
IGNORED = ("tests_pytorch/checkpointing/test_legacy_checkpoints.py",)
# (reason, pattern of the failure's message, pattern of the test's source): the first that matches names a failure.
REASONS = (
    ("BatchSizeFinder", r"BatchSizeFinder", r"BatchSizeFinder|scale_batch_size"),
    ("BatchNorm and a one-row microbatch", r"BatchNorm|min_microbatch_size|more than 1 value per channel", None),
    ("a step that records the batches it receives (sees microbatches)", None, r"\.append\(batch\b"),
    ("a counter incremented in training_step (counts microbatches)", None, r"self\._?\w+ \+= 1\b"),
    ("timeout", r"Timeout", None),
)


def _suite_trainer(variant: str) -> type:
    """``elastic_batches.lightning.Trainer`` with ``"auto"`` in place of ``accumulate_grad_batches=1`` (the default)."""
    from lightning.pytorch.callbacks import Callback

    from elastic_batches import SplitController
    from elastic_batches.lightning import ElasticAccumulation, Trainer
    from elastic_batches.lightning.callback import STAGES

    class SuiteTrainer(Trainer):
        def __init__(self, **kwargs: Any) -> None:
            accumulate = kwargs.get("accumulate_grad_batches", os.environ.get("PL_TRAINER_ACCUMULATE_GRAD_BATCHES", 1))
            if str(accumulate) == "1":
                kwargs["accumulate_grad_batches"] = "auto"
                callbacks = kwargs.get("callbacks")
                listed = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
                if variant == "split2" and not any(isinstance(c, ElasticAccumulation) for c in listed):
                    controllers = {stage: SplitController(split_count=2) for stage in STAGES}
                    kwargs["callbacks"] = [*listed, ElasticAccumulation(controllers=controllers)]
            super().__init__(**kwargs)

    SuiteTrainer.__init__.__signature__ = Trainer.__init__.__signature__  # type: ignore[attr-defined]
    SuiteTrainer.__name__ = "Trainer"  # as Lightning's tests print it
    SuiteTrainer.__qualname__ = "SuiteTrainer"
    globals()["SuiteTrainer"] = SuiteTrainer  # where pickle finds it (Lightning's tests pickle trainers)
    return SuiteTrainer


def __getattr__(name: str) -> Any:
    """``SuiteTrainer`` in a process that ``ddp_spawn`` started, where unpickling the trainer looks it up.

    Such a process imports this script anew (as ``__mp_main__``), so the class the parent made
    for its variant is rebuilt here from the variant the parent left in the environment.
    """
    variant = os.environ.get(_VARIANT_VARIABLE)
    if name == "SuiteTrainer" and variant in ("auto", "split2"):
        splits = os.environ.get(_SPLITS_VARIABLE)
        if splits:  # its split batches reach the parent through a file of its own, a stage per line
            _count_splits(lambda stage: _append(Path(f"{splits}.{os.getpid()}"), stage))
        return _suite_trainer(variant)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_VARIANT_VARIABLE = "ELASTIC_BATCHES_LIGHTNING_SUITE_VARIANT"  # for the processes ddp_spawn starts
_SPLITS_VARIABLE = "ELASTIC_BATCHES_LIGHTNING_SUITE_SPLITS"  # where they write the batches they split


def _append(path: Path, line: str) -> None:
    with path.open("a") as file:
        file.write(line + "\n")


def _count_splits(count: Callable[[str], object]) -> None:
    """Call ``count(stage)`` for every batch a stage runs as more than one microbatch."""
    from elastic_batches.lightning._stages import Stages

    report = Stages.report

    def counting_report(stages: Stages, stage: str, split_count: int, size: int) -> None:
        if split_count > 1:
            count(stage)
        report(stages, stage, split_count, size)

    Stages.report = counting_report  # type: ignore[method-assign]


_STARTS_PROCESSES = re.compile(r"ddp|spawn|devices=2|num_devices|num_processes|world_size")


class SuitePlugin:
    """A pytest plugin: one JSON line per test, with the split batches of each stage counted.

    ``processes="skip"`` deselects the tests whose source names a multi-process run (``ddp``,
    ``spawn``, ``devices=2``...): each starts processes, which on a small shared machine takes a
    minute or more per test; ``processes="only"`` keeps those alone (the rest of a run in parts).
    """

    def __init__(self, variant: str, out: Path, *, processes: str = "all") -> None:
        if processes not in ("all", "skip", "only"):
            raise ValueError(f"SuitePlugin: processes must be 'all', 'skip' or 'only', got {processes!r}")
        self.variant = variant
        self.processes = processes
        self.file = out.open("w")
        self.children = out.with_suffix(".splits")  # CHILDREN.PID: what the processes ddp_spawn starts split
        self.splits: Counter[str] = Counter()
        self.results: dict[str, dict[str, Any]] = {}
        if variant != "plain":
            self._patch()

    def _patch(self) -> None:
        import lightning.pytorch as pl
        import lightning.pytorch.trainer as pl_trainer

        trainer = _suite_trainer(self.variant)
        pl.Trainer = pl_trainer.Trainer = trainer  # what ``from lightning.pytorch import Trainer`` imports
        _count_splits(lambda stage: self.splits.update([stage]))
        os.environ[_SPLITS_VARIABLE] = str(self.children)

    def _children_splits(self) -> None:
        """Add what the processes a test started split to its count, and remove their files."""
        for path in self.children.parent.glob(f"{self.children.name}.*"):
            self.splits.update(path.read_text().split())
            path.unlink()

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        if self.processes == "all":
            return
        kept, dropped = [], []
        for item in items:
            try:
                source = inspect.getsource(item.function)
            except (OSError, TypeError, AttributeError):
                source = ""
            starts = bool(_STARTS_PROCESSES.search(source + item.nodeid))
            (dropped if starts == (self.processes == "skip") else kept).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept

    def pytest_runtest_setup(self, item: Any) -> None:
        self._children_splits()
        self.splits.clear()

    def pytest_runtest_logreport(self, report: Any) -> None:
        entry = self.results.setdefault(report.nodeid, {"test": report.nodeid, "outcome": "passed", "seconds": 0.0})
        entry["seconds"] = round(entry["seconds"] + report.duration, 3)
        if report.when == "call" and hasattr(report, "wasxfail"):
            entry["outcome"] = "xfailed" if report.skipped else "xpassed"
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            crash = getattr(report.longrepr, "reprcrash", None)
            entry["error"] = (crash.message if crash is not None else str(report.longrepr)).splitlines()[0][:400]
        if report.when == "teardown":
            self._children_splits()
            entry["splits"] = dict(self.splits)
            self.file.write(json.dumps(entry) + "\n")
            self.file.flush()

    def pytest_unconfigure(self, config: Any) -> None:
        self.file.close()


def _run(args: argparse.Namespace) -> int:
    import pytest

    tests = Path(args.tests).resolve()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ[_VARIANT_VARIABLE] = args.variant
    processes = "skip" if args.no_spawn else "only" if args.only_spawn else "all"
    plugin = SuitePlugin(args.variant, out / f"{args.variant}{args.tag}.jsonl", processes=processes)
    os.chdir(tests)
    pytest_args = ["-q", "-p", "no:cacheprovider", f"--timeout={args.timeout}", "-o", "addopts="]
    pytest_args += [f"--ignore={path}" for path in IGNORED]
    pytest_args += list(args.paths or SUITE) + list(args.pytest_args)
    return int(pytest.main(pytest_args, plugins=[plugin]))


def _load(folder: Path, variant: str) -> dict[str, dict[str, Any]]:
    """The results of ``variant``: ``VARIANT.jsonl`` and its parts ``VARIANT.TAG.jsonl``, later lines winning."""
    paths = sorted(folder.glob(f"{variant}.jsonl")) + sorted(folder.glob(f"{variant}.*.jsonl"))
    entries = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
    return {entry["test"]: entry for entry in entries}


def _source(tests: Path | None, test: str) -> str:
    """The text of ``test``'s (top-level) function in the checkout, nested functions included; ``""`` without one."""
    if tests is None:
        return ""
    path, _, name = test.partition("::")
    name = re.split(r"[\[:]", name)[-1] if "::" in name else name.split("[")[0]
    try:
        text = (tests / path).read_text()
    except OSError:
        return ""
    # from its def to the next top-level def, class or decorator
    found = re.search(rf"^def {re.escape(name)}\(.*?(?=^(?:def |class |@)|\Z)", text, re.S | re.M)
    return found.group(0) if found else ""


def _reason(error: str, source: str) -> str:
    for reason, in_error, in_source in REASONS:
        if (in_error and re.search(in_error, error)) or (in_source and re.search(in_source, source)):
            return reason
    return error.split(":")[0] or "unknown"


def _compare(args: argparse.Namespace) -> int:
    folder = Path(args.out)
    tests = Path(args.tests) if args.tests else None
    runs = {variant: results for variant in VARIANTS if (results := _load(folder, variant))}
    if "plain" not in runs:
        print(f"lightning_suite compare: no plain.jsonl in {folder}: run the plain variant first", file=sys.stderr)
        return 2
    passing = {test for test, entry in runs["plain"].items() if entry["outcome"] == "passed"}
    ran_everywhere = set.intersection(*(set(results) for results in runs.values()))
    if passing - ran_everywhere:
        print(f"{len(passing - ran_everywhere)} tests that pass plain did not run in every variant: left out")
        passing &= ran_everywhere
    print(f"{'variant':8} {'tests':>6} {'passed':>7} {'of plain passing':>17} {'failed':>7} {'split batches':>40}")
    for variant, results in runs.items():
        outcomes = Counter(entry["outcome"] for entry in results.values())
        kept = sum(1 for test in passing if results.get(test, {}).get("outcome") == "passed")
        splits: Counter[str] = Counter()
        for entry in results.values():
            splits.update(entry.get("splits", {}))
        split_text = ", ".join(f"{stage} {n}" for stage, n in sorted(splits.items())) or "-"
        failed = outcomes["failed"] + outcomes["error"]
        print(f"{variant:8} {len(results):>6} {outcomes['passed']:>7} {kept:>17} {failed:>7} {split_text:>40}")
        print(json.dumps({"variant": variant, "tests": len(results), **outcomes, "plain_passing_kept": kept}))
    for variant, results in runs.items():
        if variant == "plain":
            continue
        lost = sorted(test for test in passing if results.get(test, {}).get("outcome") != "passed")
        by_reason: dict[str, list[str]] = {}
        for test in lost:
            entry = results.get(test, {"outcome": "not run", "error": "not run"})
            reason = _reason(entry.get("error", entry["outcome"]), _source(tests, test))
            by_reason.setdefault(reason, []).append(test)
        print(f"\n{variant}: {len(lost)} of the {len(passing)} tests that pass plain do not pass")
        for reason, named in sorted(by_reason.items(), key=lambda item: -len(item[1])):
            print(f"  {len(named):4}  {reason}")
            for test in named:
                print(f"          {test}: {results.get(test, {}).get('error', '')[:160]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    run = commands.add_parser("run", help="run one variant of Lightning's tests")
    run.add_argument("--tests", default=os.environ.get("ELASTIC_BATCHES_LIGHTNING_TESTS"), help="Lightning's tests/")
    run.add_argument("--variant", choices=VARIANTS, required=True)
    run.add_argument("--out", required=True, help="folder of the JSON lines, one file per variant")
    run.add_argument("--timeout", type=int, default=180, help="seconds per test (pytest-timeout)")
    run.add_argument("--tag", default="", help="a part of a run: writes VARIANT.TAG.jsonl (e.g. --tag .rest)")
    spawn = run.add_mutually_exclusive_group()
    spawn.add_argument("--no-spawn", action="store_true", help="deselect the tests that start processes (ddp, spawn)")
    spawn.add_argument("--only-spawn", action="store_true", help="run only the tests that start processes")
    run.add_argument("paths", nargs="*", help=f"test paths under --tests (default: {' '.join(SUITE)})")
    run.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[], help="passed on to pytest")
    compare = commands.add_parser("compare", help="counts and the failures of each variant by reason")
    compare.add_argument("out", help="the folder of the runs")
    compare.add_argument("--tests", default=os.environ.get("ELASTIC_BATCHES_LIGHTNING_TESTS"), help="to read sources")
    args = parser.parse_args(argv)
    if args.command == "compare":
        return _compare(args)
    if args.command == "run" and args.tests:
        return _run(args)
    print(
        "lightning_suite: no checkout of Lightning's tests given (run --tests PATH, or set "
        "ELASTIC_BATCHES_LIGHTNING_TESTS); nothing to run"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

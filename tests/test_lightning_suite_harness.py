"""``benchmarks/lightning_suite.py``, the harness that runs Lightning's own tests under ``"auto"``.

Without a checkout of Lightning's tests: what it selects with ``--no-spawn`` / ``--only-spawn``,
that a process ``ddp_spawn`` starts can unpickle the harness's Trainer, and that the batches such
a process splits reach the parent's count.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import lightning_suite  # noqa: E402

from elastic_batches.lightning import Trainer  # noqa: E402
from elastic_batches.lightning._stages import Stages  # noqa: E402


def _in_one_process() -> None:
    pass


def _on_two_ranks() -> None:
    Trainer(strategy="ddp_spawn", devices=2)


class _Config:
    def __init__(self) -> None:
        self.deselected: list[Any] = []
        self.hook = SimpleNamespace(pytest_deselected=lambda items: self.deselected.extend(items))


def _items() -> list[Any]:
    return [
        SimpleNamespace(function=_in_one_process, nodeid="test_a.py::test_in_one_process"),
        SimpleNamespace(function=_on_two_ranks, nodeid="test_a.py::test_on_two_ranks"),
        SimpleNamespace(function=_in_one_process, nodeid="test_b.py::test_something[ddp_spawn]"),
    ]


@pytest.mark.parametrize(
    ("processes", "kept"),
    [
        ("all", ["test_in_one_process", "test_on_two_ranks", "test_something[ddp_spawn]"]),
        ("skip", ["test_in_one_process"]),
        ("only", ["test_on_two_ranks", "test_something[ddp_spawn]"]),
    ],
)
def test_the_plugin_keeps_or_leaves_out_the_tests_that_start_processes(
    tmp_path: Path, processes: str, kept: list[str]
) -> None:
    plugin = lightning_suite.SuitePlugin("plain", tmp_path / "plain.jsonl", processes=processes)
    items, config = _items(), _Config()
    plugin.pytest_collection_modifyitems(config, items)
    assert [item.nodeid.split("::")[1] for item in items] == kept
    assert len(config.deselected) == 3 - len(kept)
    plugin.file.close()


def test_a_bad_processes_setting_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="processes must be 'all', 'skip' or 'only', got 'some'"):
        lightning_suite.SuitePlugin("plain", tmp_path / "plain.jsonl", processes="some")


def test_a_process_ddp_spawn_starts_unpickles_the_suite_trainer(tmp_path: Path) -> None:
    """The worker imports the script anew, without the class the parent built: it is rebuilt there."""
    cls = lightning_suite._suite_trainer("auto")
    pickled = pickle.dumps(cls).hex()
    code = (
        "import pickle, sys\n"
        f"sys.path.insert(0, {str(BENCHMARKS)!r})\n"
        f"cls = pickle.loads(bytes.fromhex({pickled!r}))\n"
        "from elastic_batches.lightning import Trainer\n"
        "print(cls.__qualname__, issubclass(cls, Trainer))\n"
    )
    env = {**os.environ, lightning_suite._VARIANT_VARIABLE: "auto"}
    env.pop(lightning_suite._SPLITS_VARIABLE, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["SuiteTrainer", "True"]
    env.pop(lightning_suite._VARIANT_VARIABLE)  # the plain variant builds none: the lookup fails as it should
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "SuiteTrainer" in done.stderr


def test_the_batches_a_started_process_splits_reach_the_test_s_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning.pytorch as pl
    import lightning.pytorch.trainer as pl_trainer

    monkeypatch.setattr(pl, "Trainer", pl.Trainer)  # the plugin puts its own in: put Lightning's back after
    monkeypatch.setattr(pl_trainer, "Trainer", pl_trainer.Trainer)
    monkeypatch.setattr(Stages, "report", lambda stages, stage, count, size: None)
    monkeypatch.setenv(lightning_suite._SPLITS_VARIABLE, "")
    plugin = lightning_suite.SuitePlugin("auto", tmp_path / "auto.jsonl", processes="all")
    children = os.environ[lightning_suite._SPLITS_VARIABLE]
    assert children == str(plugin.children)
    plugin.pytest_runtest_setup(None)
    Stages.report(None, "train", 2, 8)  # type: ignore[arg-type]  # in this process
    Stages.report(None, "train", 1, 8)  # type: ignore[arg-type]  # whole: not counted
    Path(f"{children}.101").write_text("train\nvalidate\n")  # two workers' files
    Path(f"{children}.102").write_text("train\n")
    report = SimpleNamespace(nodeid="t.py::test", when="teardown", duration=0.0, skipped=False, failed=False)
    plugin.pytest_runtest_logreport(report)
    plugin.file.close()
    entry = (tmp_path / "auto.jsonl").read_text().strip()
    assert '"splits": {"train": 3, "validate": 1}' in entry
    assert not list(tmp_path.glob("auto.splits.*"))  # read once, then removed

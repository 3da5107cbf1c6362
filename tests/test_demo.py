"""The demo (``python -m elastic_batches demo``), run small through its Python API."""

from __future__ import annotations

import math
import os
import re
import runpy
import subprocess
import sys

import pytest
import torch

from elastic_batches import demo
from elastic_batches.demo import DemoConfig, run_demo

SMALL = {"steps": 4, "batch_size": 16, "seq_len": 8, "dim": 16, "heads": 2, "layers": 1}


@pytest.fixture(scope="module")
def small_result() -> demo.DemoResult:
    return run_demo(DemoConfig(**SMALL))


def test_demo_weights_agree_with_the_full_batch_reference(small_result: demo.DemoResult) -> None:
    assert small_result.agrees
    assert small_result.max_relative_difference <= 1e-5
    assert small_result.final_loss == pytest.approx(small_result.reference_final_loss, rel=1e-5)


def test_demo_runs_out_of_memory_and_splits(small_result: demo.DemoResult) -> None:
    assert small_result.oom_count >= 1
    assert small_result.split_count > 1
    assert small_result.microbatch_size is not None and small_result.microbatch_size < SMALL["batch_size"]
    assert small_result.split_changes and small_result.split_changes[0][1] == 1


def test_demo_stays_inside_the_simulated_memory(small_result: demo.DemoResult) -> None:
    assert small_result.one_row_bytes < small_result.limit_bytes < small_result.full_batch_bytes
    assert 0 < small_result.peak_bytes <= small_result.limit_bytes


def test_demo_learns(small_result: demo.DemoResult) -> None:
    assert small_result.first_loss == pytest.approx(math.log(DemoConfig().vocab_size), rel=0.1)
    assert small_result.final_loss < small_result.first_loss
    assert 0 < small_result.best_loss < small_result.first_loss


def test_demo_without_memory_pressure_never_splits() -> None:
    result = run_demo(DemoConfig(**{**SMALL, "steps": 2}, memory_fraction=2.0))
    assert result.oom_count == 0 and result.split_count == 1 and result.split_changes == ()
    assert result.max_relative_difference == 0.0


def test_run_demo_restores_the_thread_count() -> None:
    before = torch.get_num_threads()
    run_demo(DemoConfig(**{**SMALL, "steps": 1}, threads=1))
    assert torch.get_num_threads() == before


def test_main_exits_0_on_agreement_and_prints_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--steps", "2", "--batch-size", "16", "--seq-len", "8", "--dim", "16", "--layers", "1"]
    assert demo.main(argv) == 0
    out = capsys.readouterr().out
    assert "OOMs caught and retried" in out and "settled split" in out and ": AGREE" in out


def test_main_exits_1_when_the_weights_disagree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "_max_relative_difference", lambda a, b: 1.0)
    argv = ["--steps", "1", "--batch-size", "8", "--seq-len", "8", "--dim", "16", "--layers", "1", "--quiet"]
    assert demo.main(argv) == 1


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("steps", 0, "steps must be an int >= 1"),
        ("batch_size", 2.5, "batch_size must be an int >= 1"),
        ("heads", 3, "dim=64 must be a multiple of heads=3"),
        ("memory_fraction", 0.0, "memory_fraction must be > 0"),
        ("threads", 0, "threads must be an int >= 1"),
    ],
    ids=["steps", "batch_size", "heads", "memory_fraction", "threads"],
)
def test_config_rejects_bad_values(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DemoConfig(**{field: value})  # type: ignore[arg-type]


def test_module_entry_point_runs_the_demo(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--steps", "1", "--batch-size", "8", "--seq-len", "8", "--dim", "16", "--layers", "1", "--quiet"]
    monkeypatch.setattr(sys, "argv", ["python -m elastic_batches", "demo", *args])
    monkeypatch.delitem(sys.modules, "elastic_batches.__main__", raising=False)  # runpy runs it afresh
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("elastic_batches", run_name="__main__", alter_sys=True)
    assert exit_info.value.code == 0
    assert "AGREE" in capsys.readouterr().out


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS is enforced on Linux")
def test_demo_under_a_real_address_space_limit_splits_on_the_allocators_ooms_and_agrees() -> None:
    command = [sys.executable, "-m", "elastic_batches", "demo", "--real-allocator", "--steps", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # in a process of its own: the limit is the whole process's
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "address space limit" in result.stdout and "real CPU allocator" in result.stdout
    ooms = int(re.search(r"OOMs caught and retried : (\d+)", result.stdout).group(1))  # type: ignore[union-attr]
    assert ooms >= 1 and ": AGREE" in result.stdout

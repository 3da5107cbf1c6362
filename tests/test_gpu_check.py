"""``benchmarks/gpu_check.py`` run end to end on a CPU, against ``StandInCuda`` (the caching-allocator simulation).

The script's every call to the device module goes through the stand-in, whose functions check
their arguments as ``torch.cuda``'s do: a device without an index where CUDA needs one fails
here as it would on a GPU. The checks that hold the step's own guarantees must pass; the
prediction's targets under the caching allocator and the throughput against the sweep are
reported, not asserted (see ``docs/search.md``; the stand-in's timings are the CPU's). The
one-rank DDP and FSDP2 checks run on gloo here, NCCL on a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402

GUARANTEES = [
    "OOM in backward caught and retried",
    "OOM in forward caught and retried",
    "gradients within 1e-05 of the full batch's",
    "failed attempt freed before the retry (30k containers)",
    "user's peak kept after a probed step",
    "disguised OOMs taken for OOMs, NCCL's own named",
    "one-rank DDP: OOM voted, retried, gradient within 1e-05",
    "FSDP2 per module, one rank: retried, gradient within 1e-05",
]


@pytest.fixture(scope="module")
def default_run() -> tuple[dict[str, bool], list[list[Any]], dict[str, Any]]:
    dev = gpu_check._stand_in("default")
    return gpu_check.run_checks(dev, gpu_check.STAND_IN_SIZES["default"], "default")


@pytest.mark.parametrize("check", GUARANTEES)
def test_the_gpu_check_passes_on_the_stand_in(default_run: Any, check: str) -> None:
    checks, _, record = default_run
    assert checks[check], (check, record)


@pytest.mark.slow
def test_the_gpu_check_passes_on_the_stand_in_under_expandable_segments() -> None:
    """Every check, the prediction's and the other process's included, at the sizes 20 MiB pages need (about 80 s)."""
    dev = gpu_check._stand_in("expandable")
    checks, _, record = gpu_check.run_checks(dev, gpu_check.STAND_IN_SIZES["expandable"], "expandable")
    timed = "settled plan within 10% of the best fixed microbatch size"  # the CPU's timings: reported only
    assert all(ok for name, ok in checks.items() if name != timed), (checks, record)
    predicted = record["predicted"]
    assert predicted["capacity_with_another_process"] < predicted["capacity_before_another_process"]


def test_the_gpu_check_reports_every_measure(default_run: Any) -> None:
    checks, rows, record = default_run
    assert len(checks) == 13 and len(rows) == 15
    assert record["ddp"]["split_count"] > 1 and record["fsdp2"]["split_count"] > 1
    speed = record["throughput"]  # timed on the CPU here: reported, not asserted
    assert speed["settled_split"] >= 1 and speed["sweep_samples_per_s"] and speed["ratio"] > 0
    assert record["forward"]["ooms"] >= 1 and record["forward"]["slack_at_ooms"]  # reserved - allocated at OOMs
    assert len(record["predicted"]["counts"]) == gpu_check.PREDICTED_STEPS


def test_the_disguised_rows_include_a_first_all_reduce_of_one_rank(default_run: Any) -> None:
    _, rows, _ = default_run
    (row,) = [r for r in rows if r[1].startswith("first all-reduce")]
    assert row[2].startswith("no error")  # gloo on the CPU allocates nothing on the device


@pytest.mark.parametrize(
    ("error", "verdict"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"), "True"),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), "True"),
        (
            RuntimeError(
                "NCCL error in: ProcessGroupNCCL.cpp:3375, unhandled cuda error, NCCL version 2.21.5\n"
                "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'"
            ),
            "NCCL's own: raised, named",
        ),
        (RuntimeError("CUDA error: unspecified launch failure"), "False"),
    ],
)
def test_a_disguised_error_is_judged_as_the_step_takes_it(error: BaseException, verdict: str) -> None:
    assert gpu_check._verdict(error) == verdict


def test_a_cap_without_a_device_index_fails_on_the_stand_in_as_on_cuda() -> None:
    dev = gpu_check._stand_in("default")
    dev.index = torch.device("cuda")  # what benchmarks/cuda_oom.py passed before
    with pytest.raises(ValueError, match="Expected a torch.device with a specified index"):
        dev.cap(1 << 20)


def test_without_a_gpu_the_command_says_so_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the command would run the real check")
    assert gpu_check.main([]) == 0
    assert "no CUDA device here" in capsys.readouterr().out


def test_the_user_peak_check_fails_where_the_probe_does_not_put_the_peak_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check.AcceleratorProbe, "finish", lambda self: None)
    dev = gpu_check._stand_in("default")
    with dev.context():
        record = gpu_check._predicted(dev, gpu_check.STAND_IN_SIZES["default"])
    assert record["user_peak_after_step"] < record["user_peak"]  # the step's own windows, on an eighth of the batch

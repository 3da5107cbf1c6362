"""A real allocator OOM: ``AddressSpaceLimit`` makes torch's CPU allocator refuse, and training survives it.

The training runs in a subprocess (``tests/scripts/address_space_training.py``): the limit is on
the whole process's address space, which the test process must keep. There, the real
``RuntimeError: ... DefaultCPUAllocator: can't allocate memory`` is caught by ``ElasticStep``, the
batch is split and retried, and the final weights equal those of an unlimited full-batch run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_batches.testing import AddressSpaceLimit, address_space_bytes

SCRIPTS = Path(__file__).resolve().parent / "scripts"

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc/self/status are Linux's")


def _python(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # each thread reserves address space of its own
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    result = _python([str(SCRIPTS / "address_space_training.py")])
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_real_cpu_allocator_refused_and_the_step_split(report: dict[str, Any]) -> None:
    assert report["oom_count"] >= 1 and report["split_count"] >= 2
    assert report["errors"] and all("DefaultCPUAllocator: can't allocate memory" in e for e in report["errors"])
    assert all(e.startswith("RuntimeError: ") for e in report["errors"])  # the allocator's own, not the simulator's


def test_the_final_weights_equal_an_unlimited_full_batch_run(report: dict[str, Any]) -> None:
    assert report["max_relative_difference"] <= 1e-5


def test_the_limit_was_calibrated_below_a_full_batch_step(report: dict[str, Any]) -> None:
    room = report["limit_bytes"] - report["baseline_bytes"]
    assert report["one_row_step_bytes"] < room < report["full_step_bytes"]
    activations = report["full_step_bytes"] - report["one_row_step_bytes"]
    assert activations > 5 * report["parameter_bytes"]  # activations dominate, as the issue asks


def test_a_limit_makes_the_allocator_refuse_and_is_lifted_on_exit() -> None:
    code = """
import json, resource, torch
from elastic_batches import is_oom_error
from elastic_batches.testing import AddressSpaceLimit
AddressSpaceLimit.prepare()
before = resource.getrlimit(resource.RLIMIT_AS)
with AddressSpaceLimit(extra_bytes=32 * 2**20) as limit:
    small = torch.ones(4 * 2**20, dtype=torch.uint8)
    try:
        torch.empty(256 * 2**20, dtype=torch.uint8)
        message = None
    except RuntimeError as err:
        message, oom = str(err), is_oom_error(err)
    inside, limit_bytes = resource.getrlimit(resource.RLIMIT_AS)[0], limit.limit_bytes
after = torch.empty(256 * 2**20, dtype=torch.uint8).fill_(1)
print(json.dumps({"message": message, "oom": oom, "inside": inside, "limit": limit_bytes, "unset": limit.limit_bytes,
                  "restored": resource.getrlimit(resource.RLIMIT_AS) == before, "after": int(after[-1])}))
"""
    result = _python(["-c", code])
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert "DefaultCPUAllocator: can't allocate memory" in out["message"] and out["oom"]
    assert out["inside"] == out["limit"] and out["unset"] is None
    assert out["restored"] and out["after"] == 1


def test_address_space_bytes_sees_a_large_mapping() -> None:
    before = address_space_bytes()
    block = torch.empty(64 * 2**20, dtype=torch.uint8)
    assert address_space_bytes() >= before + 60 * 2**20
    del block


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [(-1, ValueError, r"extra_bytes must be >= 0, got -1"), (1.5, TypeError, r"extra_bytes must be an int \(bytes\)")],
    ids=["negative", "float"],
)
def test_bad_extra_bytes_are_named(value: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        AddressSpaceLimit(value)

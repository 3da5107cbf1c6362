"""``benchmarks/search_quality.py``: a policy out of memory at its smallest microbatch ends its case, reported."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import search_quality  # noqa: E402


@pytest.mark.parametrize("policy", ["predicted", "search", "halving", "x0.9"])
def test_a_policy_that_runs_out_of_memory_at_one_row_ends_its_case_as_raised(policy: str) -> None:
    ooms, counts, _ = search_quality._steps(policy, rows=16, limit=1024, steps=3)  # 1 KiB: not one row fits
    assert counts[-1] == search_quality.RAISED and len(counts) == len(ooms) <= 3 and ooms[-1] >= 1

"""``distributed.wire``: a vote carried as bytes inside a sum of another dtype comes back exact."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from elastic_batches.distributed import wire


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_vote_bytes_carry_every_vote_exactly_and_decode_again_only_when_the_sum_changes(dtype: torch.dtype) -> None:
    votes = [wire.VoteBytes(rank, 2, dtype) for rank in range(2)]

    def exchange(mine: tuple[float, ...], theirs: tuple[float, ...]) -> Any:
        return votes[0].read(votes[0].slots(mine) + votes[1].slots(theirs))  # what the sum over ranks carries

    first = exchange((1, 7, 12.5, 0.0, 96), (0, 3, 1 / 3, 1.0, 2**40))
    assert first == ((1, 7, 12.5, 0.0, 96), (0, 3, 1 / 3, 1.0, 2**40))  # float64 values whole, through any carrier
    assert exchange((1, 7, 12.5, 0.0, 96), (0, 3, 1 / 3, 1.0, 2**40)) is first  # the same sum: not decoded again
    assert exchange((1, 7, 12.5, 0.0, 96), (0, 3, 2 / 3, 1.0, 2**40)) == (
        (1, 7, 12.5, 0.0, 96),
        (0, 3, 2 / 3, 1.0, 2**40),
    )
    negative_zero = exchange((0, 7, -0.0, 0.0, 0), (0, 3, 2 / 3, 1.0, 2**40))[0][2]  # equal to 0.0, other bytes
    assert negative_zero == 0.0 and math.copysign(1.0, negative_zero) == -1.0

"""Padded positions processed: per-microbatch padding with length grouping vs padding the whole batch.

Batches of ``B`` samples with log-normal lengths go through the library's own path
(``ElasticCollate(pad_values=...)`` then ``ElasticBatch.microbatches``), and the positions of
the padded ``input_ids`` each microbatch holds are summed. Compared, at each split count:

* ``whole``: the batch padded to its longest sample and then cut by rows, which is what
  splitting an already padded batch costs (Composer's way), whatever the count;
* ``per-mb``: each microbatch padded to its own longest sample, samples in sampler order;
* ``per-mb+sort``: the same after sorting the batch longest first (the default with ``pad_values``);
* ``per-mb+sort+tokens``: sorted, and cut into token-balanced pieces (``SplitController(unit="tokens")``).

Reported: positions over ``whole`` (the issue's target: well under 0.5), positions over the real
tokens (1.0 is no padding at all), and the largest microbatch's positions over ``whole``'s largest
(what sets peak memory). No timing: the numbers are exact counts.

Run: ``python benchmarks/padding_positions.py`` (``ELASTIC_BATCHES_BENCH_QUICK=1`` for fewer batches).
"""

from __future__ import annotations

import math
import random

from _harness import QUICK, emit, table

import elastic_batches as eb

BATCHES = 20 if QUICK else 100
BATCH_SIZE = 64
COUNTS = (1, 2, 4, 8, 16)
MEDIAN, SIGMA, LONGEST = 128, 0.8, 4096  # log-normal lengths, clipped to [1, LONGEST]


def _lengths(rng: random.Random) -> list[int]:
    return [min(LONGEST, max(1, round(rng.lognormvariate(math.log(MEDIAN), SIGMA)))) for _ in range(BATCH_SIZE)]


def _positions(lengths: list[int], count: int, *, sort: bool, balance: str) -> tuple[int, int]:
    """Padded ``input_ids`` positions of all microbatches, and of the largest one."""
    import torch

    samples = [{"input_ids": torch.zeros(n, dtype=torch.int32)} for n in lengths]
    batch = eb.ElasticCollate(pad_values={"input_ids": 0}, sort_by_length=sort)(samples)
    sizes = [mb.data["input_ids"].numel() for mb in batch.microbatches(count, balance=balance)]
    return sum(sizes), max(sizes)


def main() -> None:
    rng = random.Random(0)
    batches = [_lengths(rng) for _ in range(BATCHES)]
    tokens = sum(sum(lengths) for lengths in batches)
    rows = []
    for count in COUNTS:
        whole = sum(len(lengths) * max(lengths) for lengths in batches)
        whole_largest = sum(math.ceil(len(lengths) / count) * max(lengths) for lengths in batches)
        results = {}
        for name, sort, balance in (
            ("per-mb", False, "rows"),
            ("per-mb+sort", True, "rows"),
            ("per-mb+sort+tokens", True, "tokens"),
        ):
            pairs = [_positions(lengths, count, sort=sort, balance=balance) for lengths in batches]
            results[name] = (sum(p for p, _ in pairs), sum(m for _, m in pairs))
        for name, (positions, largest) in results.items():
            record = {
                "benchmark": "padding_positions",
                "variant": name,
                "split_count": count,
                "positions_over_whole": positions / whole,
                "positions_over_tokens": positions / tokens,
                "largest_over_whole_largest": largest / whole_largest,
                "batches": BATCHES,
                "batch_size": BATCH_SIZE,
            }
            if name == "per-mb+sort" and count >= 4:  # the target: well under half the padded batch's positions
                record.update(target=0.5, met=positions / whole < 0.5)
            emit(record)
            rows.append([name, count, positions / whole, positions / tokens, largest / whole_largest])
        rows.append(["whole", count, 1.0, whole / tokens, 1.0])
    print()
    print(
        f"{BATCHES} batches of {BATCH_SIZE} samples, lengths log-normal (median {MEDIAN}, sigma {SIGMA}), "
        f"real tokens {tokens}"
    )
    print(
        table(
            ["variant", "count", "positions / whole", "positions / tokens", "largest mb / whole's largest"],
            rows,
        )
    )


if __name__ == "__main__":
    main()

"""OOMs spent on a stream of batches of varying length: rows-based vs tokens-based controller.

A stream of batches of ``B`` samples whose typical length changes from batch to batch (the
median length of each batch is drawn log-uniformly between 16 and 512 tokens; lengths within a
batch are log-normal around it) runs through ``ElasticStep`` with ``count_fn``, on two devices:

* ``oracle``: a microbatch fits when its padded positions (rows x its longest sample) are at
  most ``CAPACITY``; exact and fast, so the stream is long;
* ``budget``: ``testing.MemoryBudget`` around a small per-position language model, the memory
  measured by the tensors themselves (a shorter stream of smaller batches, for time).

Controllers compared: ``SplitController()`` (rows; ``grow_after=None``, the default), the same
with ``grow_after=4`` (it probes one microbatch fewer every 4 clean steps, so it can recover
after long batches), and ``SplitController(unit="tokens")``. Reported per device and controller:
OOMs in all, OOMs after the first 10 batches (the learning phase), microbatches run over the
fewest that fit (oracle only: ``BatchLoad.count_within(CAPACITY)`` for each batch), and padded
positions processed over the real tokens.

A third device runs the demo's tiny transformer LM (positions up to 2048) under ``MemoryBudget``
on its own stream, with the four policies of ``benchmarks/_policies.py`` side by side:
``predicted`` (``SplitController(unit="tokens")`` and the budget as the step's memory probe),
``search`` (the same without a margin: today's tokens search), ``halving`` (Composer) and ``x0.9``
(Accelerate), the last two sizing microbatches in rows as they do. For each batch, the fewest
microbatches whose tokens-balanced split fits is measured by running the splits. Reported: OOMs in
all and after the first batch, and the microbatches run over the fewest, after the first batch
(in all, and the largest ratio of one batch). The predictor's targets: no OOM after the first
batch, microbatches within 1.10x of the fewest.

Run: ``python benchmarks/padding_ooms.py`` (``ELASTIC_BATCHES_BENCH_QUICK=1`` for shorter streams).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _harness import QUICK, emit, table
from _policies import POLICIES, fewest, make, peak_at
from torch import nn

import elastic_batches as eb
from elastic_batches.demo import DemoConfig
from elastic_batches.testing import MemoryBudget

BATCH_SIZE = 32
CAPACITY = 4096  # oracle: padded positions a microbatch may hold
ORACLE_BATCHES = 100 if QUICK else 400
BUDGET_BATCHES = 15 if QUICK else 40
BUDGET_BATCH_SIZE = 16
LEARNING = 10
PAD = {"input_ids": 0, "labels": -100}
VOCAB = 64


def make_stream(batches: int, seed: int, batch_size: int = BATCH_SIZE) -> list[list[dict[str, torch.Tensor]]]:
    rng = random.Random(seed)
    stream = []
    for _ in range(batches):
        median = math.exp(rng.uniform(math.log(16), math.log(512)))
        samples = []
        for _ in range(batch_size):
            length = min(2048, max(2, round(rng.lognormvariate(math.log(median), 0.5))))
            ids = torch.randint(1, VOCAB, (length,))
            samples.append({"input_ids": ids, "labels": torch.cat([ids[1:], torch.tensor([-100])])})
        stream.append(samples)
    return stream


def count_tokens(mb: dict[str, Any]) -> torch.Tensor:
    return (mb["labels"] != -100).sum()


CONTROLLERS: dict[str, Callable[[], eb.SplitController]] = {
    "rows": lambda: eb.SplitController(),
    "rows, grow_after=4": lambda: eb.SplitController(grow_after=4),
    "tokens": lambda: eb.SplitController(unit="tokens"),
}


def run_oracle(name: str, stream: list[list[dict[str, torch.Tensor]]]) -> dict[str, Any]:
    weight = nn.Parameter(torch.zeros(()))
    holder = nn.Module()
    holder.weight = weight
    step = eb.ElasticStep(holder, controller=CONTROLLERS[name]())

    def loss_fn(mb: dict[str, Any]) -> torch.Tensor:
        if mb["input_ids"].numel() > CAPACITY:
            raise torch.OutOfMemoryError("CUDA out of memory (oracle: more padded positions than CAPACITY)")
        return weight * 0.0 + 1.0

    return _run(step, stream, loss_fn, MemoryBudget(None), fewest=lambda load: load.count_within(CAPACITY))


class PositionLM(nn.Module):
    """A per-position language model: memory grows with padded positions, as the tokens unit assumes."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def run_budget(name: str, stream: list[list[dict[str, torch.Tensor]]], limit: int) -> dict[str, Any]:
    model = PositionLM()
    step = eb.ElasticStep(model, controller=CONTROLLERS[name]())

    def loss_fn(mb: dict[str, Any]) -> torch.Tensor:
        logits = model(mb["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100)

    return _run(step, stream, loss_fn, MemoryBudget(limit), fewest=None, zero_grad=model)


def _run(
    step: eb.ElasticStep,
    stream: list[list[dict[str, torch.Tensor]]],
    loss_fn: Callable[[Any], torch.Tensor],
    budget: MemoryBudget,
    fewest: Callable[[eb.BatchLoad], int] | None,
    zero_grad: nn.Module | None = None,
) -> dict[str, Any]:
    controller = step.controller
    collate = eb.ElasticCollate(pad_values=PAD)
    positions = tokens = microbatches = best = 0
    late_ooms = 0
    attempts: list[list[int]] = []  # padded positions of each attempt's microbatches
    fresh = [True]

    def counted(mb: dict[str, Any]) -> torch.Tensor:  # called on every microbatch before an attempt runs
        if fresh[0]:
            attempts.append([])
            fresh[0] = False
        attempts[-1].append(mb["input_ids"].numel())
        return count_tokens(mb)

    def run(mb: dict[str, Any]) -> torch.Tensor:
        fresh[0] = True
        return loss_fn(mb)

    for index, samples in enumerate(stream):
        batch = collate(samples)
        before = controller.oom_count
        with budget:
            step.backward(batch, run, count_fn=counted)
        if zero_grad is not None:
            zero_grad.zero_grad(set_to_none=True)
        last = attempts[-1]  # the attempt that fitted
        positions += sum(last)
        microbatches += len(last)
        tokens += sum(len(s["input_ids"]) for s in samples)
        if fewest is not None:
            best += fewest(batch.load("tokens"))
        if index >= LEARNING:
            late_ooms += controller.oom_count - before
    return {
        "ooms": controller.oom_count,
        "ooms_after_learning": late_ooms,
        "microbatches_over_fewest": microbatches / best if best else "-",
        "positions_over_tokens": positions / tokens,
    }


LM = DemoConfig(seq_len=2048, vocab_size=VOCAB, dim=32, heads=2, layers=1)
LM_BATCHES = 12 if QUICK else 30


def _lm_loss(model: nn.Module) -> Callable[[Any], torch.Tensor]:
    def loss_fn(mb: dict[str, Any]) -> torch.Tensor:
        logits = model(mb["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100)

    return loss_fn


def run_lm() -> list[list[object]]:
    """The tiny LM's stream through every policy: OOMs, and microbatches over the fewest per batch."""
    stream = make_stream(LM_BATCHES, seed=2, batch_size=BUDGET_BATCH_SIZE)
    collate = eb.ElasticCollate(pad_values=PAD)
    batches = [collate(samples) for samples in stream]
    torch.manual_seed(0)
    probe = LM.model()
    ids = torch.randint(1, VOCAB, (1, 2048))
    with MemoryBudget() as measure:
        F.cross_entropy(probe(ids).flatten(0, 1), ids.flatten()).backward()
    limit = 3 * measure.peak_bytes // 2  # room for the longest sample (2048) while gradients accumulate
    best = []
    for batch in batches:
        peaks: dict[int, int] = {}

        def peak(count: int, batch: eb.ElasticBatch = batch, peaks: dict[int, int] = peaks) -> int:
            if count not in peaks:
                peaks[count] = peak_at(probe, _lm_loss(probe), batch, count, unit="tokens")
            return peaks[count]

        best.append(fewest(peak, len(batch), limit))
    rows_out = []
    for policy in POLICIES:
        torch.manual_seed(0)
        model = LM.model()
        runner = make(policy, model, _lm_loss(model), MemoryBudget(limit), unit="tokens")
        runner.count_fn = count_tokens
        ooms, counts = [], []
        for batch in batches:
            spent, count = runner.step(batch)
            ooms.append(spent)
            counts.append(count)
        later = sum(counts[1:]) / sum(best[1:])
        worst = max(c / b for c, b in zip(counts[1:], best[1:], strict=True))
        record: dict[str, Any] = {
            "benchmark": "padding_ooms",
            "device": "tiny LM, budget",
            "controller": policy,
            "limit_bytes": limit,
            "ooms": sum(ooms),
            "ooms_after_first_batch": sum(ooms[1:]),
            "microbatches_over_fewest_after_first": later,
            "worst_batch_over_fewest": worst,
            "microbatches": counts,
            "fewest": best,
        }
        if policy == "predicted":
            record["target"] = "ooms_after_first_batch == 0, microbatches_over_fewest_after_first <= 1.10"
            record["met"] = sum(ooms[1:]) == 0 and later <= 1.10
        emit(record)
        rows_out.append([policy, sum(ooms), sum(ooms[1:]), later, worst])
    print(
        f"\ntiny transformer LM, {LM_BATCHES} batches of {BUDGET_BATCH_SIZE}, median length log-uniform in "
        f"[16, 512], budget {limit / 2**20:.2f} MiB; fewest per batch: {best}"
    )
    print(table(["policy", "OOMs", "OOMs after batch 1", "mbs / fewest after 1", "worst batch"], rows_out))
    return rows_out


def main() -> None:
    rows = []
    oracle_stream = make_stream(ORACLE_BATCHES, seed=0)
    for name in CONTROLLERS:
        result = run_oracle(name, oracle_stream)
        record: dict[str, Any] = {"benchmark": "padding_ooms", "device": "oracle", "controller": name, **result}
        if name == "tokens":  # the target: about the fewest microbatches that fit, once learned
            record.update(target=1.05, met=float(result["microbatches_over_fewest"]) <= 1.05)
        emit(record)
        rows.append(["oracle", name, *result.values()])
    budget_stream = make_stream(BUDGET_BATCHES, seed=1, batch_size=BUDGET_BATCH_SIZE)
    probe = PositionLM()
    ids = torch.randint(1, VOCAB, (1, 2048))
    with MemoryBudget() as measure:
        F.cross_entropy(probe(ids).flatten(0, 1), ids.flatten()).backward()
    limit = 3 * measure.peak_bytes // 2  # room for the longest sample (2048) while gradients accumulate
    for name in CONTROLLERS:
        result = run_budget(name, budget_stream, limit)
        emit({"benchmark": "padding_ooms", "device": "budget", "controller": name, **result})
        rows.append(["budget", name, *result.values()])
    print()
    print(
        f"median length per batch log-uniform in [16, 512]; oracle: {ORACLE_BATCHES} batches of {BATCH_SIZE}, "
        f"capacity {CAPACITY} padded positions; budget: {BUDGET_BATCHES} batches of {BUDGET_BATCH_SIZE}, "
        f"{limit / 2**20:.2f} MiB"
    )
    print(
        table(
            ["device", "controller", "OOMs", f"OOMs after {LEARNING} batches", "mbs / fewest", "positions / tokens"],
            rows,
        )
    )
    run_lm()


if __name__ == "__main__":
    main()

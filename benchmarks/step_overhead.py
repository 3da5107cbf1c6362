"""Step overhead: ``ElasticStep.backward`` at split 4 vs a hand-written accumulation loop at 4.

Both sides run forward and backward of the same batch, on the same model, in 4 balanced
microbatches weighted by their rows, then ``zero_grad(set_to_none=True)`` (no optimizer step, so
that nothing dilutes the overhead), and both give the batch's loss, detached, as a training loop
logs it. The hand-written loop is what a careful user writes::

    loss = 0.0
    for x_i, y_i in zip(x.tensor_split(4), y.tensor_split(4)):
        weighted = loss_fn(model(x_i), y_i) * len(x_i) / len(x)
        weighted.backward()
        loss = loss + weighted.detach()

``ElasticStep`` receives what ``MicrobatchingDataLoader`` yields (an ``ElasticBatch`` that holds
the collated batch as it is: a new one every step), and does its own bookkeeping on top: set
existing gradients aside, take the batch apart and cut its fields into microbatches, rebuild the
user's structure for each, check the loss, vote (a no-op in one process), put the gradients
back and report to the controller.

Models: the demo's tiny transformer LM (64 sequences of 32 tokens), a small MLP classifier
(batch 256 of 512 features) and a tiny MLP (batch 64 of 32 features: the worst case, where the
bookkeeping is large next to the arithmetic: shown, not held to the target, which is for steps of
a few milliseconds and more). Target <= 1.03x; when missed, a profile of
``ElasticStep``'s own work is printed.

Run: ``python benchmarks/step_overhead.py`` (``ELASTIC_BATCHES_BENCH_QUICK=1``: fewer rounds).
"""

from __future__ import annotations

import cProfile
import io
import pstats
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _harness import QUICK, configure_threads, emit, interleaved, median, paired_ratio, table
from torch import nn

from elastic_batches import ElasticBatch, ElasticStep, SplitController
from elastic_batches.demo import DemoConfig
from elastic_batches.demo_model import lm_loss

TARGET = 1.03
SPLIT = 4
ROUNDS = 7 if QUICK else 15
STEPS_PER_ROUND = 5 if QUICK else 10


def _lm_case() -> tuple[nn.Module, dict[str, torch.Tensor], Callable[[nn.Module, Any], torch.Tensor]]:
    config = DemoConfig()
    torch.manual_seed(0)
    model = config.model()
    tokens = torch.randint(config.vocab_size, (config.batch_size, config.seq_len + 1))
    return model, {"tokens": tokens}, lm_loss


def _mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _mlp_case(rows: int, width: int, hidden: int) -> tuple[nn.Module, Any, Callable[[nn.Module, Any], torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
    )
    return model, (torch.randn(rows, width), torch.randint(10, (rows,))), _mlp_loss


def _split_by_hand(batch: Any, split: int) -> list[Any]:
    if isinstance(batch, dict):
        pieces = {k: v.tensor_split(split) for k, v in batch.items()}
        return [{k: pieces[k][i] for k in batch} for i in range(split)]
    columns = [t.tensor_split(split) for t in batch]
    return [tuple(c[i] for c in columns) for i in range(split)]


def _rows(batch: Any) -> int:
    return len(next(iter(batch.values())) if isinstance(batch, dict) else batch[0])


def main() -> None:
    threads = configure_threads()
    cases = {
        "tiny LM, 64 x 32 tokens": _lm_case(),
        "MLP 512-1024-1024, batch 256": _mlp_case(256, 512, 1024),
        "tiny MLP 32-64-64, batch 64": _mlp_case(64, 32, 64),
    }
    # The 1 ms step shows the fixed cost at its largest; the target holds for steps of a few ms and more.
    informational = {"tiny MLP 32-64-64, batch 64"}
    rows_out = []
    records = []
    for name, (model, batch, loss_fn) in cases.items():
        rows = _rows(batch)
        step = ElasticStep(model, controller=SplitController(split_count=SPLIT))

        def by_hand(model: nn.Module = model, batch: Any = batch, loss_fn: Any = loss_fn, rows: int = rows) -> None:
            for _ in range(STEPS_PER_ROUND):
                total: Any = 0.0  # the batch's loss, as ElasticStep returns it
                for piece in _split_by_hand(batch, SPLIT):
                    weighted = loss_fn(model, piece) * (_rows(piece) / rows)
                    weighted.backward()
                    total = total + weighted.detach()
                model.zero_grad(set_to_none=True)

        def elastic(model: nn.Module = model, batch: Any = batch, loss_fn: Any = loss_fn, step: Any = step) -> None:
            for _ in range(STEPS_PER_ROUND):
                loaded = ElasticBatch.deferred(batch)  # what MicrobatchingDataLoader yields, new every step
                step.backward(loaded, lambda mb: loss_fn(model, mb))
                model.zero_grad(set_to_none=True)

        times = interleaved({"by hand": by_hand, "elastic": elastic}, ROUNDS)
        ratio = paired_ratio(times["elastic"], times["by hand"])
        hand_ms = 1e3 * median(times["by hand"]) / STEPS_PER_ROUND
        elastic_ms = 1e3 * median(times["elastic"]) / STEPS_PER_ROUND
        targeted = name not in informational
        met = ratio <= TARGET if targeted else "n/a"
        rows_out.append([name, hand_ms, elastic_ms, 1e3 * (elastic_ms - hand_ms), ratio, met])
        record = {
            "benchmark": "step_overhead",
            "case": name,
            "split_count": SPLIT,
            "rounds": ROUNDS,
            "steps_per_round": STEPS_PER_ROUND,
            "by_hand_ms_per_step": hand_ms,
            "elastic_ms_per_step": elastic_ms,
            "ratio": ratio,
        }
        if targeted:
            record.update(target=TARGET, met=ratio <= TARGET)
        records.append(record)
        if targeted and ratio > TARGET:
            profiler = cProfile.Profile()
            profiler.enable()
            elastic()
            profiler.disable()
            stream = io.StringIO()
            stats = pstats.Stats(profiler, stream=stream).sort_stats("cumulative")
            stats.print_stats("elastic_batches|tensordict", 14)
            print(f"--- {name}: {ratio:.3f}x is over the {TARGET}x target; ElasticStep's own work:")
            print(stream.getvalue())
    print(f"step overhead: forward + backward at split {SPLIT}, median of {ROUNDS} interleaved rounds, {threads}")
    print(
        table(["model", "by hand ms/step", "elastic ms/step", "extra us/step", "elastic/by hand", "<= 1.03"], rows_out)
    )
    for record in records:
        emit(record)


if __name__ == "__main__":
    main()

"""Lightning overhead: ``Trainer(accumulate_grad_batches="auto")`` vs the plain ``lightning.pytorch.Trainer``.

Same model, data and Trainer arguments (the classifier of ``examples/lightning_auto.py``: 32
features, two hidden layers of 256, AdamW, batches of 256). Variants, timed from the start of
the second training batch to the end of the last one (Trainer set-up excluded):

* ``plain``: the plain Trainer on batches of 256;
* ``auto, split 1``: ``"auto"`` with nothing to split — the cost of the integration itself
  (taking the batch apart, recording ``self.log``, the vote, the controller);
* ``auto, split 2``: ``"auto"`` with the train controller at 2 microbatches of 128;
* ``lightning accumulate 2``: the plain Trainer with ``accumulate_grad_batches=2`` on batches of
  128 — what a user would write by hand for the same microbatches.

Target for ``auto, split 1`` <= 1.05x plain.

Run: ``python benchmarks/lightning_overhead.py`` (``ELASTIC_BATCHES_BENCH_QUICK=1``: fewer rounds).
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from _harness import QUICK, configure_threads, emit, median, paired_ratio, table
from torch.utils.data import DataLoader

from elastic_batches import SplitController
from elastic_batches.lightning import ElasticAccumulation, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from lightning_auto import Classifier, make_data, trainer_kwargs  # noqa: E402

TARGET = 1.05
ROUNDS = 3 if QUICK else 7
STEPS = 20 if QUICK else 60
BATCH = 256


class _StepClock(pl.Callback):
    """Seconds from the start of the second training batch to the end of the last one."""

    def __init__(self) -> None:
        self.start = 0.0
        self.end = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx == 1:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.end = time.perf_counter()


def _run(variant: str) -> float:
    clock = _StepClock()
    kwargs = trainer_kwargs(1, limit_val_batches=0, gradient_clip_val=None, callbacks=[clock])
    data = make_data(BATCH * (STEPS + 1))
    if variant == "plain":
        trainer, batch = pl.Trainer(**kwargs), BATCH
    elif variant == "auto, split 1":
        trainer, batch = Trainer(accumulate_grad_batches="auto", **kwargs), BATCH
    elif variant == "auto, split 2":
        elastic = ElasticAccumulation(controllers={"train": SplitController(split_count=2)})
        trainer, batch = Trainer(accumulate_grad_batches="auto", **{**kwargs, "callbacks": [clock, elastic]}), BATCH
    else:
        trainer, batch = pl.Trainer(**{**kwargs, "accumulate_grad_batches": 2}), BATCH // 2
    trainer.fit(Classifier(), DataLoader(data, batch_size=batch))
    steps = trainer.global_step - 1
    return (clock.end - clock.start) / steps


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    threads = configure_threads()
    variants = ["plain", "auto, split 1", "auto, split 2", "lightning accumulate 2"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    _run("plain")  # warm-up
    for round_ in range(ROUNDS):
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            times[variant].append(_run(variant))
    rows = []
    for variant in variants:
        ratio = paired_ratio(times[variant], times["plain"])
        rows.append([variant, 1000 * median(times[variant]), ratio])
        record: dict[str, object] = {
            "benchmark": "lightning_overhead",
            "variant": variant,
            "ms_per_step": 1000 * median(times[variant]),
            "ratio_to_plain": ratio,
            "threads": threads,
        }
        if variant == "auto, split 1":  # the target: nothing split costs at most 5% over the plain Trainer
            record.update(target=TARGET, met=ratio <= TARGET)
        emit(record)
    print(f"Lightning overhead ({threads}, {ROUNDS} rounds of {STEPS} steps, batches of {BATCH})")
    print(table(["variant", "ms/step", "vs plain"], rows))
    split1 = paired_ratio(times["auto, split 1"], times["plain"])
    print(f"auto, split 1 vs plain: {split1:.3f}x (target <= {TARGET}x): {'met' if split1 <= TARGET else 'MISSED'}")


if __name__ == "__main__":
    main()

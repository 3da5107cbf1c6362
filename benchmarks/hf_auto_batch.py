"""HF's ``auto_find_batch_size=True`` against ``elastic_batches.transformers.Trainer``, under the same budget.

A tiny GPT-2 (``support.hf_models``) trains ``STEPS`` optimizer steps at
``per_device_train_batch_size=16`` on the same variable-length texts, three ways:

* ``fits``: HF's ``Trainer`` without a memory limit: the run whose batch fits, the reference;
* ``hf auto_find_batch_size``: HF's ``Trainer(auto_find_batch_size=True)`` inside a
  ``MemoryBudget`` too small for 16 rows: on an OOM, Accelerate's ``find_executable_batch_size``
  restarts the training loop with a batch 0.9 times as large (``gradient_accumulation_steps``
  unchanged);
* ``elastic Trainer``: this library's ``Trainer`` with the same arguments, inside the same budget.

Printed for each: the effective batch of an optimizer step (rows), the OOMs raised, the seconds
from ``train()`` to the end of the first optimizer step, the final logged loss, and its gap to
the reference's final loss (the same data at the same step, when the batch is kept). The machine
may be shared: the times are for orientation, the batches, OOMs and losses are what the run
measures.

Run: ``python benchmarks/hf_auto_batch.py`` (``ELASTIC_BATCHES_BENCH_QUICK=1``: fewer steps).
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import transformers
from _harness import QUICK, configure_threads, emit, table

from elastic_batches.testing import MemoryBudget
from elastic_batches.transformers import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness lives in tests/support
from support.hf_models import client  # noqa: E402

BATCH = 16
STEPS = 4 if QUICK else 8
BUDGET = 1_500_000  # bytes: a tiny GPT-2, its SGD state and about 8 of the 16 rows


class FirstStep(transformers.TrainerCallback):
    """Records when the first optimizer step ends."""

    def __init__(self) -> None:
        self.at: float | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.at is None:
            self.at = time.perf_counter()


def run(cls: type, budget: int | None, auto: bool, folder: str) -> dict[str, Any]:
    model, collator, samples = client("gpt2", rows=BATCH * STEPS * 2)
    args = transformers.TrainingArguments(
        folder,
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        auto_find_batch_size=auto,
        optim="sgd",
        learning_rate=0.5,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        log_level="error",
        seed=0,
    )
    first = FirstStep()
    trainer = cls(model=model, args=args, train_dataset=samples, data_collator=collator, callbacks=[first])
    trainer.remove_callback(transformers.PrinterCallback)
    start = time.perf_counter()
    with MemoryBudget(budget) as memory:
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        "effective_batch": trainer.state.train_batch_size * args.gradient_accumulation_steps * args.world_size,
        "ooms": memory.oom_count,
        "first_step_s": (first.at or start) - start,
        "final_loss": losses[-1],
    }


def main() -> None:
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    threads = configure_threads()
    with tempfile.TemporaryDirectory() as folder:
        results = {
            "fits": run(transformers.Trainer, None, False, folder),
            "hf auto_find_batch_size": run(transformers.Trainer, BUDGET, True, folder),
            "elastic Trainer": run(Trainer, BUDGET, True, folder),
        }
    reference = results["fits"]["final_loss"]
    rows = []
    for name, result in results.items():
        gap = result["final_loss"] - reference
        rows.append(
            [name, result["effective_batch"], result["ooms"], result["first_step_s"], result["final_loss"], gap]
        )
        emit({"bench": "hf_auto_batch", "variant": name, **result, "loss_gap": gap})
    print(
        f"tiny GPT-2, {STEPS} optimizer steps at per_device_train_batch_size={BATCH}, budget {BUDGET} bytes, {threads}"
    )
    headers = ["run", "effective batch", "OOMs", "first step (s)", "final loss", "vs fits"]
    print(table(headers, rows))


if __name__ == "__main__":
    main()

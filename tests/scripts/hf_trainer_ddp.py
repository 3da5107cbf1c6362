"""``elastic_batches.transformers.Trainer`` on several processes; run by tests/test_transformers_accelerate.py.

Under ``torchrun --nproc-per-node 2`` (gloo, CPU) HF's Trainer wraps the tiny GPT-2 in DDP
through Accelerate; each rank trains inside its own ``MemoryBudget`` (``--budgets``, one per
rank, 0 for none), so rank 1 runs out of memory where rank 0 does not. Run alone, it is the
single-process reference at the same global batch (``--batch`` rows per process, times
``--accumulate`` batches per optimizer step). The sampler
is sequential, so that both see the same rows in the same steps. Rank 0 saves the final weights,
the log history and every rank's controller to ``--out``.
Imports the harness (``support.hf_models``): ``tests/`` on ``PYTHONPATH``, as the test sets it.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import torch
import transformers

from elastic_batches.testing import MemoryBudget
from elastic_batches.transformers import Trainer

from support.hf_models import client
from support.process_group import close_process_group

STEPS = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--budgets", type=int, nargs="+", required=True)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--elastic", action="store_true")
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()

    args = transformers.TrainingArguments(
        f"{options.out}.run",
        per_device_train_batch_size=options.batch,
        gradient_accumulation_steps=options.accumulate,
        max_steps=STEPS,
        optim="sgd",
        learning_rate=0.5,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        train_sampling_strategy="sequential",
    )
    model, collator, samples = client("gpt2", rows=32 * STEPS * options.accumulate)
    # the elastic Trainer with the OOM-driven search (memory=None): the ranks' agreement on each OOM is tested
    elastic = {"memory": None} if options.elastic else {}
    cls: Any = Trainer if options.elastic else transformers.Trainer
    trainer = cls(model=model, args=args, train_dataset=samples, data_collator=collator, **elastic)
    rank = args.process_index
    limit = options.budgets[rank] or None
    with MemoryBudget(limit):
        trainer.train()
    controllers = None
    if options.elastic:
        controllers = trainer.accelerator.gather(torch.tensor([trainer.split_controller.oom_count])).tolist()
    if rank == 0:
        weights = {
            k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()
        }
        torch.save({"weights": weights, "logs": trainer.state.log_history, "ooms": controllers}, options.out)


if __name__ == "__main__":
    main()
    close_process_group()  # before the interpreter exits, where gloo's threads can abort a finished rank

"""A plain Accelerate loop with ``ElasticStep``; run by tests/test_transformers_accelerate.py.

One process, or several under ``accelerate launch``/``torchrun`` (gloo on CPUs): ``model,
optimizer, loader = accelerator.prepare(...)``, then ``ElasticStep(model,
backward_fn=accelerator.backward)`` instead of ``accelerator.backward``, each rank inside its own
``MemoryBudget`` (``--budgets``, one per rank: ranks that run out of memory at different sizes).
With ``--accumulate N`` the loop runs under ``accelerator.accumulate(model)`` with
``gradient_accumulation_steps=N``; ``--rows`` is the global batch of one optimizer step. Rank 0
saves the final weights and each rank's OOM count to ``--out`` (a ``torch.save`` file).
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn

import elastic_batches as eb
from elastic_batches.testing import MemoryBudget

from support.process_group import close_process_group

FEATURES, ROWS, STEPS = 32, 64, 3  # ROWS: the global batch of one optimizer step (by default)


def model_and_data(rows: int = ROWS) -> tuple[nn.Module, torch.utils.data.TensorDataset]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 1))
    x = torch.randn(rows * STEPS, FEATURES)
    return model, torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--budgets", type=int, nargs="+", required=True)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--rows", type=int, default=ROWS)
    options = parser.parse_args()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=options.accumulate)
    model, data = model_and_data(options.rows)
    per_process = options.rows // (accelerator.num_processes * options.accumulate)
    loader = torch.utils.data.DataLoader(data, batch_size=per_process)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    step = eb.ElasticStep(model, backward_fn=accelerator.backward, memory=None)  # the OOM-driven search

    with MemoryBudget(options.budgets[accelerator.process_index] or None):  # 0: no limit
        for x, y in loader:
            with accelerator.accumulate(model):
                step.backward((x, y), lambda mb: nn.functional.mse_loss(model(mb[0]), mb[1]))
                optimizer.step()  # Accelerate's optimizer steps only at the end of an accumulation
                optimizer.zero_grad()
    ooms = accelerator.gather(torch.tensor([step.controller.oom_count])).tolist()
    if accelerator.is_main_process:
        weights = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        torch.save({"weights": weights, "ooms": ooms}, options.out)


if __name__ == "__main__":
    main()
    close_process_group()  # before the interpreter exits, where gloo's threads can abort a finished rank

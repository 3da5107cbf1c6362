"""Run by tests/test_address_space.py: train under a real address-space limit, then without one.

An MLP whose activations dominate its memory (a batch of 2048 rows through 1024-wide layers:
about 60 MiB of activations, against 4.3 MiB of weights) trains a few steps with
``MicrobatchingDataLoader`` and ``ElasticStep`` inside :class:`AddressSpaceLimit`: the real CPU
allocator refuses the full batch (``DefaultCPUAllocator: can't allocate memory``), the step
splits the batch and retries it. The limit is calibrated here, from the address space in use
once the model, the data and the optimizer state exist, plus what a step needs as measured by
``MemoryBudget``: the step's fixed part (gradients), the temporary that accumulating the largest
gradient takes, a share of the full batch's activations and some headroom. The same steps then
run without a limit, as a plain full-batch loop, from the same weights. Prints one JSON line.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import elastic_batches as eb
import elastic_batches.oom
from elastic_batches.testing import AddressSpaceLimit, MemoryBudget, address_space_bytes

ROWS, FEATURES, WIDTH, CLASSES, STEPS = 2048, 64, 1024, 10, 3
ACTIVATION_SHARE = 0.3  # of the full batch's activations: about 3 microbatches must fit it
HEADROOM = 8 * 2**20  # for what Python and autograd allocate besides tensors


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, CLASSES)
    )


def loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * ROWS, FEATURES, generator=generator)
    data = TensorDataset(x, torch.randint(CLASSES, (STEPS * ROWS,), generator=generator))
    return DataLoader(data, batch_size=ROWS, shuffle=True, generator=torch.Generator().manual_seed(2))


def step_bytes(net: nn.Module, rows: int) -> int:
    """Peak bytes of a training step on ``rows`` rows (gradients from None, as in training)."""
    x, y = torch.randn(rows, FEATURES), torch.randint(CLASSES, (rows,))
    with MemoryBudget() as budget:
        F.cross_entropy(net(x), y).backward()
    net.zero_grad(set_to_none=True)
    return budget.peak_bytes


def main() -> int:
    AddressSpaceLimit.prepare()  # before anything is allocated: no freed heap in the baseline
    torch.set_num_threads(1)  # each thread reserves address space of its own
    seen: list[str] = []
    is_oom_error = elastic_batches.oom.is_oom_error

    def recording(err: BaseException) -> bool:
        seen.append(f"{type(err).__name__}: {err}"[:200])
        return is_oom_error(err)

    elastic_batches.oom.is_oom_error = recording  # the errors ElasticStep classifies, for the report
    initial = model()
    net, reference = copy.deepcopy(initial), copy.deepcopy(initial)
    one_row, full = step_bytes(net, 1), step_bytes(net, ROWS)
    largest_gradient = max(p.numel() * p.element_size() for p in net.parameters())
    extra = one_row + largest_gradient + int(ACTIVATION_SHARE * (full - one_row)) + HEADROOM

    batches = eb.MicrobatchingDataLoader(loader())
    step = eb.ElasticStep(net, controller=batches.controller)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for p in net.parameters():  # the momentum buffers exist before the limit, as after a first step
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    data = list(batches)  # collated before the limit: the data is not what is measured
    baseline = address_space_bytes()
    with AddressSpaceLimit(extra) as limit:
        for batch in data:
            step.backward(batch, lambda mb: F.cross_entropy(net(mb[0]), mb[1]))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        limit_bytes = limit.limit_bytes
    # the same steps without a limit: a plain full-batch loop
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for p in reference.parameters():
        plain.state[p]["momentum_buffer"] = torch.zeros_like(p)
    for x, y in loader():
        F.cross_entropy(reference(x), y).backward()
        plain.step()
        plain.zero_grad(set_to_none=True)
    difference = max(
        float((p - q).abs().max() / q.abs().max())
        for p, q in zip(net.state_dict().values(), reference.state_dict().values(), strict=True)
    )
    report = {
        "baseline_bytes": baseline,
        "limit_bytes": limit_bytes,
        "extra_bytes": extra,
        "one_row_step_bytes": one_row,
        "full_step_bytes": full,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in net.parameters()),
        "oom_count": batches.controller.oom_count,
        "split_count": batches.controller.split_count,
        "errors": seen[:4],
        "max_relative_difference": difference,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

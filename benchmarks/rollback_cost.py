"""What saving a step's buffers and random state costs (``Rollback``), per step, next to the step itself.

Before its first attempt, ``ElasticStep`` saves what a failed attempt could leave behind besides
gradients: the random generators, and the model's buffers. Only buffers that a forward may
change in place have their data copied (normalization layers' running statistics in training
mode, buffers seen changing); a constant buffer is copied at the first step only. Measured on
the CPU, side by side in one process:

* ``rollback us/step``: ``Rollback.save`` then ``commit`` (a step that went through), steady
  state (after the first step);
* ``copy-all us/step``: the naive alternative, cloning every buffer and the generator state
  every step;
* ``step ms``: forward and backward of the batch, unsplit, by hand (what the rollback is paid
  against), and the rollback's share of it.

Models: a BatchNorm CNN (16 residual blocks of conv-BN-ReLU-conv-BN, 16 channels, batch 32 of
3x32x32: 33 BatchNorm layers, 99 buffers), and the demo's tiny transformer LM with a 2048 x
2048 float32 causal-mask cache (16 MiB, never changed) registered as a buffer.

Run: ``python benchmarks/rollback_cost.py`` (``ELASTIC_BATCHES_BENCH_QUICK=1``: fewer rounds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _harness import QUICK, configure_threads, emit, interleaved, median, table
from torch import nn

from elastic_batches.demo import DemoConfig
from elastic_batches.demo_model import lm_loss
from elastic_batches.rollback import Rollback

ROUNDS = 7 if QUICK else 21
CALLS = 20 if QUICK else 100  # rollback calls per round
CPU = [torch.device("cpu")]


class _Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def _cnn_case() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        *[_Block(16) for _ in range(16)],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    x, y = torch.randn(32, 3, 32, 32), torch.randint(10, (32,))
    return model, lambda: F.cross_entropy(model(x), y)


def _lm_case() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    config = DemoConfig()
    torch.manual_seed(0)
    model = config.model()
    model.register_buffer("causal_mask", torch.ones(2048, 2048).tril())  # a cache that never changes
    tokens = torch.randint(config.vocab_size, (config.batch_size, config.seq_len + 1))
    return model, lambda: lm_loss(model, {"tokens": tokens})


def _copy_all(model: nn.Module) -> None:
    torch.get_rng_state()
    for buffer in model.buffers():
        buffer.clone()


def main() -> None:
    threads = configure_threads()
    cases = {"BatchNorm CNN, batch 32 x 3x32x32": _cnn_case(), "tiny LM + 16 MiB constant buffer": _lm_case()}
    rows_out = []
    for name, (model, loss) in cases.items():
        rollback = Rollback(model)
        rollback.save(CPU)
        loss().backward()  # the first step: learns which buffers change
        rollback.commit()

        def saved(rollback: Rollback = rollback) -> None:
            for _ in range(CALLS):
                rollback.save(CPU)
                rollback.commit()

        def copied(model: nn.Module = model) -> None:
            for _ in range(CALLS):
                _copy_all(model)

        def step(model: nn.Module = model, loss: Any = loss) -> None:
            loss().backward()
            model.zero_grad(set_to_none=True)

        times = interleaved({"rollback": saved, "copy all": copied}, ROUNDS)
        step_times = interleaved({"step": step}, max(3, ROUNDS // 3))
        rollback_us = 1e6 * median(times["rollback"]) / CALLS
        copy_us = 1e6 * median(times["copy all"]) / CALLS
        step_ms = 1e3 * median(step_times["step"])
        buffers = sum(1 for _ in model.buffers())
        rows_out.append([name, buffers, step_ms, rollback_us, copy_us, 100 * rollback_us / (1e3 * step_ms)])
        emit(
            {
                "benchmark": "rollback_cost",
                "case": name,
                "buffers": buffers,
                "step_ms": step_ms,
                "rollback_us_per_step": rollback_us,
                "copy_all_us_per_step": copy_us,
                "share_of_step": rollback_us / (1e3 * step_ms),
            }
        )
    print(f"rollback cost: median of {ROUNDS} interleaved rounds of {CALLS} calls, {threads}")
    print(table(["model", "buffers", "step ms", "rollback us/step", "copy-all us/step", "% of the step"], rows_out))


if __name__ == "__main__":
    main()

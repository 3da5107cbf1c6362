"""The demo behind ``python -m elastic_batches demo``: a tiny language model that does not fit.

A small causal transformer learns a generated language (a random Markov chain over a few dozen
tokens) on the CPU, with batches of 64 sequences, inside a
:class:`~elastic_batches.testing.MemoryBudget` that holds only a fraction of the memory one full
batch needs. ``MicrobatchingDataLoader`` and ``ElasticStep`` catch the simulated out-of-memory
errors, cut each batch into more microbatches and retry it. A second run with the same seed and
no budget (one plain full-batch ``loss.backward()`` per step, no elastic_batches code at all)
then checks that both runs end with the same weights.

With ``real_allocator`` (``--real-allocator``, Linux), there is no simulation: the elastic run
trains under an :class:`~elastic_batches.testing.AddressSpaceLimit`, a limit on the process's
address space, and the OOMs are the CPU allocator's own (``DefaultCPUAllocator: can't allocate
memory``). Run it in a process of its own: it sets the process's malloc up for the limit.

The demo is an application of the library: it is the only place in the package that configures
logging (a handler on the ``elastic_batches`` logger, in :func:`main`, so that each change of the
split count is shown).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import logging
import math
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from elastic_batches._state import is_int
from elastic_batches.controller import SplitController
from elastic_batches.demo_model import MarkovLanguage, TinyLM, lm_loss
from elastic_batches.loader import MicrobatchingDataLoader
from elastic_batches.step import ElasticStep
from elastic_batches.testing import AddressSpaceLimit, MemoryBudget

__all__ = ["DemoConfig", "DemoResult", "main", "run_demo"]


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Sizes and settings of the demo run.

    Attributes:
        steps: Optimizer steps (one batch each).
        batch_size: Sequences per batch: the batch the optimizer sees, whatever the split.
        seq_len: Tokens per sequence the model reads (each sample holds one more, the last target).
        vocab_size: Tokens in the generated language.
        dim: Embedding width of the model.
        heads: Attention heads per layer.
        layers: Transformer blocks.
        memory_fraction: Size of the simulated device: it holds what a step needs whatever the
            batch size (gradients, optimizer state; the weights are not counted) plus this
            fraction of what grows with the batch (activations) for a full batch. About
            ``memory_fraction * batch_size`` rows then fit in one microbatch; below 1, the full
            batch does not fit and has to be split.
        lr: Learning rate of SGD with momentum 0.9.
        seed: Seeds the model, the language and the data order; both runs use it.
        tolerance: Largest relative difference of the final weights accepted as agreement.
        threads: torch intra-op threads during the run (restored afterwards). The model is so
            small that more threads only add synchronisation, and on a busy machine they stall.
        real_allocator: Train under a real limit on the process's address space instead of the
            simulated device (Linux): the device memory is then a limit on address space above
            what the process uses when the elastic run starts, sized as for the simulated one
            plus the temporary that accumulating the largest gradient takes and 4 MiB for
            what Python allocates besides tensors. Changes the process's malloc settings.

    Example:
        >>> from elastic_batches.demo import DemoConfig
        >>> DemoConfig(steps=5).batch_size
        64
    """

    steps: int = 80
    batch_size: int = 64
    seq_len: int = 32
    vocab_size: int = 48
    dim: int = 64
    heads: int = 4
    layers: int = 2
    memory_fraction: float = 0.2
    lr: float = 0.1
    seed: int = 0
    tolerance: float = 1e-5
    threads: int = 1
    real_allocator: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "vocab_size", "dim", "heads", "layers", "threads"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"DemoConfig: {name} must be an int >= 1, got {value!r}")
        if self.dim % self.heads:
            raise ValueError(f"DemoConfig: dim={self.dim} must be a multiple of heads={self.heads}")
        if not 0 < self.memory_fraction:
            raise ValueError(f"DemoConfig: memory_fraction must be > 0, got {self.memory_fraction!r}")

    def model(self) -> TinyLM:
        """A new demo language model of these sizes (initialized from torch's current seed).

        Example:
            >>> from elastic_batches.demo import DemoConfig
            >>> DemoConfig(layers=1).model().pos.shape
            torch.Size([32, 64])
        """
        return TinyLM(self.vocab_size, self.dim, self.heads, self.layers, self.seq_len)


@dataclasses.dataclass(frozen=True)
class DemoResult:
    """What the demo measured.

    Attributes:
        max_relative_difference: Over all parameter tensors, the largest
            ``max|w - w_ref| / max|w_ref|`` between the elastic run's final weights and the
            reference's.
        agrees: ``max_relative_difference <= tolerance``.
        oom_count: Out-of-memory errors caught and recovered from by the elastic run.
        split_count: Microbatches per batch at the end.
        microbatch_size: The settled microbatch size (rows), ``None`` if nothing was learned.
        split_changes: ``(step, old count, new count)`` for each step whose count differed from
            the previous step's.
        full_batch_bytes: Peak bytes one full-batch step needs (measured without a limit).
        one_row_bytes: Peak bytes a step on a batch of one row needs.
        limit_bytes: The simulated device's memory (with ``real_allocator``: the address space
            allowed above the baseline).
        peak_bytes: The highest memory use of the elastic run (never above ``limit_bytes``);
            ``None`` with ``real_allocator``, where the kernel enforces the limit and nothing
            counts the peak.
        first_loss: Mean loss of the first batch (about ``log(vocab_size)``).
        final_loss: Mean loss of the last batch of the elastic run.
        reference_final_loss: The same for the reference run.
        best_loss: The entropy of the generated language: the lowest loss any model can reach.
        elastic_seconds: Wall time of the elastic run.
        reference_seconds: Wall time of the reference run.

    Example:
        >>> from elastic_batches.demo import DemoConfig, run_demo
        >>> result = run_demo(DemoConfig(steps=2, batch_size=8, seq_len=8, dim=16, layers=1))
        >>> result.agrees, result.oom_count > 0
        (True, True)
    """

    max_relative_difference: float
    agrees: bool
    oom_count: int
    split_count: int
    microbatch_size: int | None
    split_changes: tuple[tuple[int, int, int], ...]
    full_batch_bytes: int
    one_row_bytes: int
    limit_bytes: int
    peak_bytes: int | None
    first_loss: float
    final_loss: float
    reference_final_loss: float
    best_loss: float
    elastic_seconds: float
    reference_seconds: float


# -- the language and the model -------------------------------------------------------------------


def _loader(dataset: MarkovLanguage, config: DemoConfig) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(config.seed + 1)
    return DataLoader(dataset, batch_size=config.batch_size, shuffle=True, drop_last=True, generator=generator)


def _optimizer(model: nn.Module, config: DemoConfig) -> torch.optim.Optimizer:
    # SGD, not Adam: Adam divides each element by its own running scale, which turns the float32
    # rounding that differs between a full and a split batch into a visible change of the update.
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)


def _max_relative_difference(a: nn.Module, b: nn.Module) -> float:
    worst = 0.0
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        scale = q.detach().abs().max().item()
        diff = (p.detach() - q.detach()).abs().max().item()
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


_REAL_HEADROOM = 4 * 2**20  # under a real limit: what Python and autograd allocate besides tensors


# -- the runs --------------------------------------------------------------------------------------


def _measure_step(model: nn.Module, dataset: MarkovLanguage, config: DemoConfig, rows: int) -> int:
    """Peak bytes of a training step on ``rows`` rows, measured on a copy of the model.

    Two steps are run: the optimizer's state (momentum) is created by the first and is alive
    during the whole second one, as in training.
    """
    model = copy.deepcopy(model)
    optimizer = _optimizer(model, config)
    batch = {"tokens": dataset.tokens[:rows]}
    budget = MemoryBudget(limit_bytes=None)
    with budget:
        for _ in range(2):
            lm_loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return budget.peak_bytes


def _train_elastic(
    model: nn.Module,
    dataset: MarkovLanguage,
    config: DemoConfig,
    budget: MemoryBudget | None,
    out: TextIO | None,
) -> tuple[SplitController, list[float], list[tuple[int, int, int]]]:
    loader = MicrobatchingDataLoader(_loader(dataset, config))
    step = ElasticStep(model, controller=loader.controller, memory=None)  # the OOM-driven search, as shown
    optimizer = _optimizer(model, config)
    losses: list[float] = []
    changes: list[tuple[int, int, int]] = []
    with tqdm(total=config.steps, desc="elastic  ", file=out, disable=out is None) as progress:
        batches: Iterator[Any] = iter(loader)
        previous = loader.controller.split_count
        for index in range(config.steps):
            batch = next(batches)
            with budget if budget is not None else contextlib.nullcontext():  # the simulated device, if any
                loss = step.backward(batch, lambda mb: lm_loss(model, mb))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            count = loader.controller.split_count
            if count != previous:
                changes.append((index, previous, count))
                previous = count
            progress.set_postfix(
                loss=f"{losses[-1]:.3f}",
                microbatches=f"{count} x <={math.ceil(config.batch_size / count)}",
                OOMs=loader.controller.oom_count,
                refresh=False,
            )
            progress.update()
    return loader.controller, losses, changes


def _train_reference(model: nn.Module, dataset: MarkovLanguage, config: DemoConfig, out: TextIO | None) -> list[float]:
    optimizer = _optimizer(model, config)
    losses: list[float] = []
    batches = iter(_loader(dataset, config))
    with tqdm(total=config.steps, desc="reference", file=out, disable=out is None) as progress:
        for _ in range(config.steps):
            batch = next(batches)
            loss = lm_loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            progress.set_postfix(loss=f"{losses[-1]:.3f}", microbatches=1, refresh=False)
            progress.update()
    return losses


def run_demo(config: DemoConfig | None = None, *, out: TextIO | None = None) -> DemoResult:
    """Train the tiny language model under a memory budget, then without one, and compare.

    Args:
        config: Sizes and settings; :class:`DemoConfig` defaults when ``None``.
        out: Where progress bars go (``None``: silent). The split-count changes are log records
            of the ``elastic_batches`` logger; :func:`main` shows them.

    Returns:
        A :class:`DemoResult`.

    Example:
        >>> from elastic_batches.demo import DemoConfig, run_demo
        >>> result = run_demo(DemoConfig(steps=2, batch_size=8, seq_len=8, dim=16, layers=1))
        >>> result.split_count > 1, result.peak_bytes <= result.limit_bytes
        (True, True)
    """
    config = config if config is not None else DemoConfig()
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _run(config, out)
    finally:
        torch.set_num_threads(threads)


def _run(config: DemoConfig, out: TextIO | None) -> DemoResult:
    if config.real_allocator:
        AddressSpaceLimit.prepare()  # before the run allocates: no freed heap in the baseline
        tqdm.monitor_interval = 0  # no monitor thread: its stack would count against the address-space limit
    torch.manual_seed(config.seed)
    dataset = MarkovLanguage(config.batch_size * config.steps, config.seq_len, config.vocab_size, config.seed)
    initial = config.model()

    full_batch_bytes = _measure_step(initial, dataset, config, config.batch_size)
    one_row_bytes = _measure_step(initial, dataset, config, 1)
    limit_bytes = one_row_bytes + int((full_batch_bytes - one_row_bytes) * config.memory_fraction)

    elastic_model = copy.deepcopy(initial)
    start = time.perf_counter()
    if config.real_allocator:
        # accumulating a gradient materialises it first: room for the largest one twice
        largest_gradient = max(p.numel() * p.element_size() for p in initial.parameters())
        limit_bytes += largest_gradient + _REAL_HEADROOM
        budget = None
        with AddressSpaceLimit(limit_bytes, configure_malloc=True):
            controller, losses, changes = _train_elastic(elastic_model, dataset, config, None, out)
    else:
        budget = MemoryBudget(limit_bytes=limit_bytes)
        controller, losses, changes = _train_elastic(elastic_model, dataset, config, budget, out)
    elastic_seconds = time.perf_counter() - start

    reference_model = copy.deepcopy(initial)
    start = time.perf_counter()
    reference_losses = _train_reference(reference_model, dataset, config, out)
    reference_seconds = time.perf_counter() - start

    difference = _max_relative_difference(elastic_model, reference_model)
    return DemoResult(
        max_relative_difference=difference,
        agrees=difference <= config.tolerance,
        oom_count=controller.oom_count,
        split_count=controller.split_count,
        microbatch_size=controller.microbatch_size,
        split_changes=tuple(changes),
        full_batch_bytes=full_batch_bytes,
        one_row_bytes=one_row_bytes,
        limit_bytes=limit_bytes,
        peak_bytes=None if budget is None else budget.peak_bytes,
        first_loss=losses[0],
        final_loss=losses[-1],
        reference_final_loss=reference_losses[-1],
        best_loss=dataset.entropy(),
        elastic_seconds=elastic_seconds,
        reference_seconds=reference_seconds,
    )


def _kib(n: int) -> str:
    return f"{n / 1024:.0f} KiB"


def _report(result: DemoResult, config: DemoConfig, out: TextIO) -> None:
    verdict = "AGREE" if result.agrees else "DISAGREE"
    if result.peak_bytes is None:
        memory = (
            f"address space limit     : {_kib(result.limit_bytes)} above the baseline, real CPU allocator "
            f"(a step on 1 sequence needs {_kib(result.one_row_bytes)}, on the full batch of {config.batch_size} "
            f"{_kib(result.full_batch_bytes)})"
        )
    else:
        memory = (
            f"simulated device memory : {_kib(result.limit_bytes)} "
            f"(a step on 1 sequence needs {_kib(result.one_row_bytes)}, on the full batch of {config.batch_size} "
            f"{_kib(result.full_batch_bytes)}; peak used {_kib(result.peak_bytes)})"
        )
    lines = [
        "",
        memory,
        f"OOMs caught and retried : {result.oom_count}",
        f"settled split           : {result.split_count} microbatches of at most "
        f"{math.ceil(config.batch_size / result.split_count)} (microbatch size learned: {result.microbatch_size})",
        "split count changes     : "
        + (", ".join(f"step {s}: {a} -> {b}" for s, a, b in result.split_changes) or "none"),
        f"loss                    : {result.first_loss:.3f} -> {result.final_loss:.3f} "
        f"(reference {result.reference_final_loss:.3f}; the language's entropy, the best possible, "
        f"is {result.best_loss:.3f})",
        f"time                    : elastic {result.elastic_seconds:.1f}s under the limit, "
        f"reference {result.reference_seconds:.1f}s",
        f"final weights vs the full-batch reference: max relative difference {result.max_relative_difference:.2e} "
        f"(tolerance {config.tolerance:.0e}): {verdict}",
    ]
    print("\n".join(lines), file=out, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line of the demo (``python -m elastic_batches demo --help``).

    Returns:
        0 when the final weights agree with the reference, 1 otherwise.

    Example:
        >>> from elastic_batches.demo import main
        >>> main(["--steps", "2", "--batch-size", "8", "--seq-len", "8", "--dim", "16", "--layers", "1", "--quiet"])
        ... # doctest: +ELLIPSIS
        max relative difference ...: AGREE
        0
    """
    defaults = DemoConfig()
    parser = argparse.ArgumentParser(
        prog="python -m elastic_batches demo",
        description="Train a tiny transformer language model on the CPU under a simulated memory budget that forces "
        "the batch to be split, then check the final weights against a full-batch reference run.",
    )
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per batch")
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens per sequence")
    parser.add_argument("--dim", type=int, default=defaults.dim, help="embedding width")
    parser.add_argument("--layers", type=int, default=defaults.layers, help="transformer blocks")
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=defaults.memory_fraction,
        help="simulated memory: the fixed part of a step plus this fraction of a full batch's activations, so "
        "about this fraction of the batch fits in one microbatch (default %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--real-allocator",
        action="store_true",
        help="no simulation: train under a real limit on the process's address space (Linux), so that the OOMs "
        "are the CPU allocator's own ('DefaultCPUAllocator: can't allocate memory')",
    )
    parser.add_argument("--quiet", action="store_true", help="print only the verdict line")
    args = parser.parse_args(argv)
    config = DemoConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        dim=args.dim,
        layers=args.layers,
        memory_fraction=args.memory_fraction,
        seed=args.seed,
        real_allocator=args.real_allocator,
    )
    out = sys.stdout

    library_logger = logging.getLogger("elastic_batches")
    handler = None
    old_level = library_logger.level
    if not args.quiet:
        handler = logging.StreamHandler(out)
        handler.setFormatter(logging.Formatter("  [%(name)s] %(message)s"))
        library_logger.addHandler(handler)
        library_logger.setLevel(logging.INFO)
        print(
            f"elastic_batches demo: a {config.layers}-layer transformer LM (width {config.dim}) learns a generated "
            f"language, {config.steps} steps of {config.batch_size} sequences x {config.seq_len} tokens, on the CPU "
            + (
                "under a limit on the process's address space (the real CPU allocator refuses past it)"
                if config.real_allocator
                else "inside a simulated device"
            )
            + f" with room for about {config.memory_fraction:.0%} of a batch.",
            file=out,
            flush=True,
        )
    try:
        with logging_redirect_tqdm(loggers=[library_logger]):  # log lines above the progress bars, not through
            result = run_demo(config, out=None if args.quiet else out)
    finally:
        if handler is not None:
            library_logger.removeHandler(handler)
            library_logger.setLevel(old_level)
    if args.quiet:
        print(
            f"max relative difference {result.max_relative_difference:.2e}: {'AGREE' if result.agrees else 'DISAGREE'}"
        )
    else:
        _report(result, config, out)
    return 0 if result.agrees else 1

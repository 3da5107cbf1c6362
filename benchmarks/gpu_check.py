"""The GPU check: real caching-allocator OOMs caught, retried and predicted; one command, a table, exit 1 on a failure.

Run ``python benchmarks/gpu_check.py`` on a machine with one CUDA device (under 5 minutes). It
runs every check twice, each time in a fresh process: under the default caching allocator and
under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``. Without a GPU it says so and exits
0; ``--stand-in`` runs the same logic on a CPU against ``elastic_batches.testing.StandInCuda``
(a stand-in for ``torch.cuda``'s memory functions over the caching-allocator simulation, whose
functions check their arguments as the real ones do): the test suite runs it that way
(``tests/test_gpu_check.py``), so a wrong call is caught without a GPU.

The checks, per allocator:

1. **Retried in forward and in backward.** A memory cap (``set_per_process_memory_fraction``)
   between the forward's and the full step's peak makes the first attempt fail in backward; one
   under the forward's peak makes it fail in forward. Both are retried, and the gradient equals
   the full batch's (computed before any cap; TF32 off) within 1e-5 relative.
2. **Freed before the retry.** The failing microbatch makes a tensor and 30,000 short-lived
   containers; at the retry's first forward the tensor is dead and the allocated bytes are those
   of the step's start.
3. **Predicted.** A fresh controller with the CUDA probe (``memory="auto"``): OOMs until its
   count settles (at most 1) and after (none), predicted against measured peak per microbatch,
   and reserved minus allocated bytes at each OOM (what fragmentation held).
4. **The user's peak statistics.** A peak of the user's before a probed step is still what
   ``max_memory_allocated()`` reports after it.
5. **Memory taken by another process after the plan.** Another process (on the stand-in, the
   stand-in's ``take_by_another_process``) takes the device's free memory after the count
   settled, all but what leaves this process a fifth less than its cap (another process takes
   the device's memory, not this one's fraction: on a large GPU a small amount taken would
   change nothing); the probe's capacity falls, and the next steps adapt without
   ``ElasticOOMError`` and end with no OOM.
6. **Disguised OOMs.** With the device filled to within a few MiB, a first matmul (cuBLAS
   creates its handle and workspace), a first convolution (cuDNN) and a one-rank group's first
   all-reduce (NCCL makes its communicator and buffers; gloo on the stand-in), each in a new
   thread (the handles are per thread, and the checks before made this thread's): the error's type,
   message and how the step takes it: ``is_oom_error`` must take any allocation failure for an
   OOM, except NCCL's own, which ``is_nccl_oom`` must recognise (raised with its cause, not
   retried: a failed communicator is not safe to reuse).

7. **One-rank DDP with the vote.** A one-rank process group (NCCL on a GPU, gloo on the stand-in)
   and a DDP model under a cap the full batch does not fit: the OOM is voted on, the batch
   retried, and the gradient equals the full batch's.
8. **FSDP2 per module on one rank.** ``fully_shard`` on each layer and the root, the step with
   ``gather="module"``, the same cap: retried, the gradient (``full_tensor()``) equals the full
   batch's.
9. **Throughput of the settled plan.** The predicting step's settled split, timed over a few
   steps, against a sweep of fixed microbatch sizes (each the OOM-free split of a fixed count):
   its samples per second over the best of the sweep (reported; at least 0.9 on a GPU is the
   target, timings on the stand-in are the CPU's).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _harness import emit, table

from elastic_batches import ElasticStep, SplitController, is_oom_error
from elastic_batches.memory import AcceleratorProbe
from elastic_batches.oom import is_nccl_oom, release_memory

RTOL = 1e-5
PREDICTED_STEPS = 6
ALLOCATORS = {"default": "", "expandable": "expandable_segments:True"}


@dataclasses.dataclass
class Device:
    """Where the check runs: ``torch.cuda`` and a CUDA device, or the stand-in and the CPU."""

    module: Any  # torch.cuda, or an elastic_batches.testing.StandInCuda
    index: torch.device  # the device the memory functions are called with (cuda:0)
    tensors: torch.device  # where tensors are made (cuda:0, or the CPU under the stand-in)
    total: int
    context: Callable[[], contextlib.AbstractContextManager[Any]]  # the stand-in's budget, entered

    def cap(self, nbytes: int) -> None:
        self.module.set_per_process_memory_fraction(min(1.0, nbytes / self.total), self.index)


def _cuda() -> Device:
    index = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(index).total_memory
    return Device(torch.cuda, index, index, total, contextlib.nullcontext)


def _stand_in(allocator: str) -> Device:
    from elastic_batches.testing import StandInCuda

    total = 256 << 20 if allocator == "default" else 1 << 30
    cuda = StandInCuda(total, allocator="caching" if allocator == "default" else "expandable")
    return Device(cuda, torch.device("cuda", 0), torch.device("cpu"), cuda.total_bytes, lambda: cuda.budget)


@dataclasses.dataclass
class Sizes:
    rows: int
    width: int
    hidden: int


GPU_SIZES = Sizes(rows=4096, width=1024, hidden=8192)
# on the stand-in, per allocator: expandable segments map the large pool in 20 MiB pages, so its blocks must be
# several pages (32 MiB activations here) for a cap between two splits' peaks to exist at all
STAND_IN_SIZES = {
    "default": Sizes(rows=2048, width=64, hidden=768),
    "expandable": Sizes(rows=8192, width=64, hidden=2048),
}


def _model(dev: Device, sizes: Sizes) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(sizes.width, sizes.hidden),
        torch.nn.GELU(),
        torch.nn.Linear(sizes.hidden, sizes.hidden),
        torch.nn.GELU(),
        torch.nn.Linear(sizes.hidden, 1),
    ).to(dev.tensors)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g - w).abs().max() / w.abs().max().clamp_min(1e-30)) for g, w in zip(got, want, strict=True))


class _Watch:
    """Wraps ``loss_fn`` and backward: where each OOM struck, reserved minus allocated then, and the retry's start."""

    def __init__(self, dev: Device, model: torch.nn.Module, containers: int = 0) -> None:
        self.dev, self.model, self.containers = dev, model, containers
        self.phases: list[str] = []
        self.slack: list[int] = []  # reserved - allocated bytes at each OOM
        self.made: weakref.ref[torch.Tensor] | None = None
        self.at_retry: tuple[bool, int] | None = None  # (the failed microbatch's tensor alive, allocated bytes)
        self.start = 0

    def _oom(self, phase: str) -> None:
        self.phases.append(phase)
        module, index = self.dev.module, self.dev.index
        self.slack.append(int(module.memory_reserved(index)) - int(module.memory_allocated(index)))

    def loss_fn(self, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.phases and self.at_retry is None:
            gc_free = self.made is not None and self.made() is not None
            self.at_retry = (gc_free, int(self.dev.module.memory_allocated(self.dev.index)))
        try:
            hidden = self.model[1](self.model[0](mb[0]))
            if self.made is None and self.containers:
                self.made = weakref.ref(hidden)
                junk = [[i] for i in range(self.containers)]
                del junk
            return (self.model[4](self.model[3](self.model[2](hidden))) - mb[1]).pow(2).mean()
        except Exception as err:
            if is_oom_error(err):
                self._oom("forward")
            raise

    def backward(self, loss: torch.Tensor) -> None:
        try:
            loss.backward()
        except Exception as err:
            if is_oom_error(err):
                self._oom("backward")
            raise


def _peaks(dev: Device, model: torch.nn.Module, batch: Any) -> tuple[int, int, int]:
    """Bytes reserved at rest, at the full batch's forward peak and at its whole step's (no cap).

    Reserved, not allocated: a cap (``set_per_process_memory_fraction``) limits what the caching
    allocator reserves, segments and their unused ends included.
    """
    module, index = dev.module, dev.index
    model.zero_grad(set_to_none=True)
    module.empty_cache()
    rest = int(module.memory_reserved(index))
    module.reset_peak_memory_stats(index)
    loss = (model(batch[0]) - batch[1]).pow(2).mean()
    forward = int(module.max_memory_reserved(index))
    loss.backward()
    del loss
    step = int(module.max_memory_reserved(index))
    return rest, forward, step


def _trial(dev: Device, model: torch.nn.Module, batch: Any) -> str:
    """Where a plain full-batch step runs out of memory under the current cap: forward, backward or none."""
    phase = "forward"
    try:
        loss = (model(batch[0]) - batch[1]).pow(2).mean()
        phase = "backward"
        loss.backward()
        phase = "none"
    except Exception as err:
        if not is_oom_error(err):
            raise
    loss = None
    model.zero_grad(set_to_none=True)
    release_memory()
    return phase


def _cap_failing_in(dev: Device, model: torch.nn.Module, batch: Any, where: str, high: int) -> int:
    """The highest cap (to 1 MiB) under which the full batch fails in ``where`` (``"backward"``: anywhere).

    Just under what the full batch needs, so that the split retry, whose activations are
    smaller, has room for the gradient that accumulating materialises twice.
    """
    low = int(dev.module.memory_reserved(dev.index))
    while high - low > 1 << 20:
        cap = (low + high) // 2
        dev.cap(cap)
        phase = _trial(dev, model, batch)
        fails = phase == "forward" if where == "forward" else phase != "none"
        low, high = (cap, high) if fails else (low, cap)
    return low


def _retried(dev: Device, sizes: Sizes, where: str, containers: int) -> dict[str, Any]:
    """Checks 1 and 2: a cap that makes the first attempt fail in ``where``; the retry's gradient and start."""
    model = _model(dev, sizes)
    batch = (torch.randn(sizes.rows, sizes.width, device=dev.tensors), torch.randn(sizes.rows, 1, device=dev.tensors))
    _, _, peak = _peaks(dev, model, batch)
    reference = _grads(model)  # kept here through the step
    model.zero_grad(set_to_none=True)
    dev.module.empty_cache()
    cap = _cap_failing_in(dev, model, batch, where, high=2 * peak)
    dev.cap(cap)
    watch = _Watch(dev, model, containers)
    step = ElasticStep(model, controller=SplitController(margin=None), backward_fn=watch.backward, memory=None)
    watch.start = int(dev.module.memory_allocated(dev.index))
    step.backward(batch, watch.loss_fn)
    dev.cap(dev.total)  # the comparison allocates
    error = _relative_error(_grads(model), reference)
    model.zero_grad(set_to_none=True)
    alive, at_retry = watch.at_retry if watch.at_retry is not None else (True, -1)
    return {
        "ooms": len(watch.phases),
        "first_oom_in": watch.phases[0] if watch.phases else "none",
        "phases": watch.phases,
        "split_count": step.controller.split_count,
        "gradient_relative_error": error,
        "failed_tensor_alive_at_retry": alive,
        "allocated_at_retry_over_start": at_retry - watch.start,
        "slack_at_ooms": watch.slack,
    }


def _predicted(dev: Device, sizes: Sizes) -> dict[str, Any]:
    """Checks 3, 4 and 5: the predicting controller under a cap, the user's peak, another process's memory."""
    model = _model(dev, sizes)
    batch = (torch.randn(sizes.rows, sizes.width, device=dev.tensors), torch.randn(sizes.rows, 1, device=dev.tensors))
    rest, _, peak = _peaks(dev, model, batch)
    reference = _grads(model)
    model.zero_grad(set_to_none=True)
    dev.module.empty_cache()
    cap = rest + (peak - rest) // 2
    dev.cap(cap)
    controller = SplitController()
    probe = AcceleratorProbe(dev.index, module=dev.module)
    watch = _Watch(dev, model)
    step = ElasticStep(model, controller=controller, backward_fn=watch.backward, memory=probe)
    counts, ooms = [], []
    for _ in range(PREDICTED_STEPS):
        step.backward(batch, watch.loss_fn)
        if not counts:
            dev.cap(dev.total)  # the comparison allocates
            error = _relative_error(_grads(model), reference)
            dev.cap(cap)
        model.zero_grad(set_to_none=True)
        counts.append(controller.split_count)
        ooms.append(controller.oom_count)
    settled = next(i for i in range(len(counts)) if len(set(counts[i:])) == 1)
    # check 4: a peak of the user's before a probed step survives it (a step on an eighth of the batch peaks lower)
    module, index = dev.module, dev.index
    module.reset_peak_memory_stats(index)
    users = torch.empty(int((cap - rest) * 0.6) // 4, device=dev.tensors)
    user_peak = int(module.max_memory_allocated(index))
    del users
    eighth = len(batch[0]) // 8
    step.backward((batch[0][:eighth], batch[1][:eighth]), watch.loss_fn)
    model.zero_grad(set_to_none=True)
    peak_after = int(module.max_memory_allocated(index))
    # check 5: another process takes the device's free memory but what leaves this one a fifth less than its cap
    module.empty_cache()  # what this process's cache holds, no other process can take
    capacity_before = probe.memory_reading().capacity
    with _another_process(dev, cap - int(module.memory_reserved(index)) - (cap - rest) // 5):
        capacity_then = probe.memory_reading().capacity
        before = controller.oom_count
        for _ in range(4):
            step.backward(batch, watch.loss_fn)
            model.zero_grad(set_to_none=True)
        taken_ooms, last = controller.oom_count - before, controller.oom_count
        step.backward(batch, watch.loss_fn)
        model.zero_grad(set_to_none=True)
        taken_last = controller.oom_count - last
    dev.cap(dev.total)
    return {
        "counts": counts,
        "ooms_until_settled": ooms[settled],
        "ooms_after_settled": ooms[-1] - ooms[settled],
        "gradient_relative_error": error,
        "slack_at_ooms": watch.slack,
        "user_peak": user_peak,
        "user_peak_after_step": peak_after,
        "capacity_before_another_process": capacity_before,
        "capacity_with_another_process": capacity_then,
        "ooms_after_another_process": taken_ooms,
        "ooms_in_the_last_step_then": taken_last,
        "model": controller.memory.describe() if controller.memory is not None else "",
    }


@contextlib.contextmanager
def _one_rank(dev: Device, bound: bool = True) -> Iterator[None]:
    """A process group of one rank: NCCL on a GPU, gloo on the stand-in (a file rendezvous, no port).

    ``bound``: NCCL's communicator is made at once on ``dev``; else by the first collective.
    """
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as folder:
        backend = "nccl" if dev.module is torch.cuda else "gloo"
        options: dict[str, Any] = {"device_id": dev.index} if backend == "nccl" and bound else {}
        dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=0, world_size=1, **options)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _full(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]


def _distributed(dev: Device, sizes: Sizes, kind: str) -> dict[str, Any]:
    """Checks 7 and 8: one rank's DDP or FSDP2 (per module) step under a cap the full batch does not fit."""
    model = _model(dev, sizes)
    batch = (torch.randn(sizes.rows, sizes.width, device=dev.tensors), torch.randn(sizes.rows, 1, device=dev.tensors))
    _peaks(dev, model, batch)
    reference = _grads(model)
    model.zero_grad(set_to_none=True)
    with _one_rank(dev):
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [dev.index] if dev.module is torch.cuda else None
            wrapped: torch.nn.Module = DistributedDataParallel(model, device_ids=ids)
        else:
            from torch.distributed.fsdp import fully_shard

            for index in (0, 2, 4):
                fully_shard(model[index])
            wrapped = fully_shard(model)
        rest, _, peak = _peaks(dev, wrapped, batch)  # the wrapper's own memory (sharded parameters, buckets) in it
        model.zero_grad(set_to_none=True)
        dev.module.empty_cache()
        dev.cap(rest + (peak - rest) // 2)
        step = ElasticStep(wrapped, controller=SplitController(margin=None), gather="module", memory=None)
        step.backward(batch, lambda mb, net=wrapped: (net(mb[0]) - mb[1]).pow(2).mean())
        dev.cap(dev.total)  # the comparison allocates
        error = _relative_error(_full(_grads(model)), reference)
        ooms, split = step.controller.oom_count, step.controller.split_count
        model.zero_grad(set_to_none=True)
        del step, wrapped, model
        gc.collect()  # the wrapper's hooks and buckets form cycles: freed before the next check
        dev.module.empty_cache()
    return {"ooms": ooms, "split_count": split, "gradient_relative_error": error}


def _timed(dev: Device, step: ElasticStep, model: torch.nn.Module, batch: Any, steps: int) -> float:
    """Samples per second of ``steps`` steps (after one untimed)."""
    loss_fn = lambda mb: (model(mb[0]) - mb[1]).pow(2).mean()  # noqa: E731
    step.backward(batch, loss_fn)
    model.zero_grad(set_to_none=True)
    dev.module.synchronize(dev.index)
    start = time.perf_counter()
    for _ in range(steps):
        step.backward(batch, loss_fn)
        model.zero_grad(set_to_none=True)
    dev.module.synchronize(dev.index)
    return steps * len(batch[0]) / (time.perf_counter() - start)


def _throughput(dev: Device, sizes: Sizes, steps: int = 3) -> dict[str, Any]:
    """Check 9: the settled plan's samples per second against the best fixed microbatch size of a sweep."""
    model = _model(dev, sizes)
    batch = (torch.randn(sizes.rows, sizes.width, device=dev.tensors), torch.randn(sizes.rows, 1, device=dev.tensors))
    rest, _, peak = _peaks(dev, model, batch)
    model.zero_grad(set_to_none=True)
    dev.module.empty_cache()
    dev.cap(rest + (peak - rest) // 2)
    probe = AcceleratorProbe(dev.index, module=dev.module)
    predicted = ElasticStep(model, controller=SplitController(), memory=probe)
    for _ in range(PREDICTED_STEPS):  # until it settles
        predicted.backward(batch, lambda mb: (model(mb[0]) - mb[1]).pow(2).mean())
        model.zero_grad(set_to_none=True)
    settled = predicted.controller.split_count
    speed = _timed(dev, predicted, model, batch, steps)
    sweep: dict[int, float] = {}
    for count in sorted({max(1, settled // 2), settled, settled + 1, 2 * settled, 4 * settled}):
        fixed = ElasticStep(model, controller=SplitController(split_count=count, margin=None), memory=None)
        try:
            rate = _timed(dev, fixed, model, batch, steps)
        except Exception as err:
            if not is_oom_error(err):
                raise
            release_memory(err)
            continue
        if fixed.controller.split_count == count:  # it ran at that count: no OOM raised it
            sweep[count] = rate
    dev.cap(dev.total)
    best = max(sweep.values(), default=float("nan"))
    return {
        "settled_split": settled, "settled_samples_per_s": speed, "sweep_samples_per_s": sweep, "ratio": speed / best,
    }  # fmt: skip


def _hold(left: int, ready: Any, done: Any) -> None:  # pragma: no cover (a GPU child process)
    free, _ = torch.cuda.mem_get_info()  # after this process's own context took its share
    size, held = free - left, None
    while held is None and size > 0:  # the allocator rounds up (20 MiB pages when expandable): a page less each time
        try:
            held = torch.empty(size, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            size -= 20 << 20
    ready.set()
    done.wait()
    del held


@contextlib.contextmanager
def _another_process(dev: Device, left: int) -> Iterator[None]:
    """Inside the block another process holds the device's free memory, all but ``left`` bytes."""
    if dev.module is not torch.cuda:
        free, _ = dev.module.mem_get_info(dev.index)
        dev.module.take_by_another_process(dev.module.other_process_bytes + max(0, free - left))
        try:
            yield
        finally:
            dev.module.take_by_another_process(0)
        return
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ready, done = context.Event(), context.Event()
    child = context.Process(target=_hold, args=(left, ready, done))
    child.start()
    ready.wait(60)
    try:
        yield
    finally:
        done.set()
        child.join(60)


def _first_all_reduce(dev: Device, tensor: torch.Tensor) -> None:
    """A one-rank group's first all-reduce: NCCL makes its communicator and buffers in it (on a GPU)."""
    import torch.distributed as dist

    with _one_rank(dev, bound=False):
        dist.all_reduce(tensor)
        if dev.module is torch.cuda:
            torch.cuda.synchronize(dev.index)


def _verdict(err: BaseException) -> str:
    """How the step takes ``err``: retried (``True``), NCCL's own OOM (raised with its cause), or not an OOM."""
    return "NCCL's own: raised, named" if is_nccl_oom(err) else str(is_oom_error(err))


def _in_a_new_thread(case: Callable[[], Any]) -> None:
    """``case()`` in a thread of its own, its error raised here.

    cuBLAS and cuDNN handles are per thread: the checks before made this thread's, and a new
    thread's first matmul and convolution create theirs on the full device.
    """
    errors: list[BaseException] = []

    def run() -> None:
        try:
            case()
        except BaseException as err:  # raised in the caller's thread
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def _disguised(dev: Device) -> list[list[str]]:
    """Check 6: a first matmul, a first convolution and a first NCCL all-reduce on a device filled to a few MiB."""
    module, index = dev.module, dev.index
    module.empty_cache()
    reduced = torch.ones(1 << 20, device=dev.tensors)  # made before the device is full
    free, _ = module.mem_get_info(index)
    filler: list[torch.Tensor] = []
    chunk = 64 << 20
    with contextlib.suppress(Exception):
        while free > (4 << 20) + chunk:
            filler.append(torch.empty(chunk, dtype=torch.uint8, device=dev.tensors))
            free, _ = module.mem_get_info(index)
    with contextlib.suppress(Exception):
        while True:
            filler.append(torch.empty(1 << 20, dtype=torch.uint8, device=dev.tensors))
    rows = []
    cases: dict[str, Callable[[], Any]] = {
        "first matmul (cuBLAS)": lambda: torch.mm(
            torch.randn(256, 256, device=dev.tensors), torch.randn(256, 256, device=dev.tensors)
        ),
        "first convolution (cuDNN)": lambda: torch.nn.functional.conv2d(
            torch.randn(8, 16, 64, 64, device=dev.tensors), torch.randn(32, 16, 3, 3, device=dev.tensors)
        ),
        "first all-reduce (NCCL, one rank)": lambda: _first_all_reduce(dev, reduced),
    }  # fmt: skip
    for name, case in cases.items():
        try:
            _in_a_new_thread(case)
            rows.append([name, "no error", "", "-"])
        except Exception as err:
            rows.append([name, type(err).__name__, str(err).splitlines()[0][:90], _verdict(err)])
    filler.clear()
    release_memory()
    return rows


_FAILED_RETRIED: dict[str, Any] = {
    "ooms": 0, "first_oom_in": "none", "phases": [], "split_count": 0, "gradient_relative_error": float("inf"),
    "failed_tensor_alive_at_retry": True, "allocated_at_retry_over_start": -1, "slack_at_ooms": [],
}  # fmt: skip
_FAILED_PREDICTED: dict[str, Any] = {
    "counts": [], "ooms_until_settled": 99, "ooms_after_settled": 99, "gradient_relative_error": float("inf"),
    "slack_at_ooms": [], "user_peak": 1, "user_peak_after_step": 0, "capacity_before_another_process": 0,
    "capacity_with_another_process": 0, "ooms_after_another_process": -1, "ooms_in_the_last_step_then": 99,
    "model": "",
}  # fmt: skip


_FAILED_DISTRIBUTED: dict[str, Any] = {"ooms": 0, "split_count": 0, "gradient_relative_error": float("inf")}
_FAILED_THROUGHPUT: dict[str, Any] = {
    "settled_split": 0, "settled_samples_per_s": 0.0, "sweep_samples_per_s": {}, "ratio": 0.0,
}  # fmt: skip


def _guarded(check: Callable[..., dict[str, Any]], failed: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``check(*args, **kwargs)``; if it raises an OOM error (``ElasticOOMError`` among them), a failed record."""
    try:
        return check(*args, **kwargs)
    except Exception as err:
        if not is_oom_error(err):
            raise
        print(f"gpu_check: {check.__name__}{args[2:]} raised {type(err).__name__}: {str(err).splitlines()[0][:200]}")
        release_memory(err)
        args[0].cap(args[0].total)
        return {**failed, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}


def run_checks(dev: Device, sizes: Sizes, allocator: str) -> tuple[dict[str, bool], list[list[Any]], dict[str, Any]]:
    """Every check on ``dev``: the verdicts, the table's rows and a record."""
    with dev.context():
        backward = _guarded(_retried, _FAILED_RETRIED, dev, sizes, "backward", containers=0)
        forward = _guarded(_retried, _FAILED_RETRIED, dev, sizes, "forward", containers=30_000)
        predicted = _guarded(_predicted, _FAILED_PREDICTED, dev, sizes)
        ddp = _guarded(_distributed, _FAILED_DISTRIBUTED, dev, sizes, "ddp")
        fsdp = _guarded(_distributed, _FAILED_DISTRIBUTED, dev, sizes, "fsdp2")
        speed = _guarded(_throughput, _FAILED_THROUGHPUT, dev, sizes)
        disguised = _disguised(dev)
    checks = {
        "OOM in backward caught and retried": "backward" in backward["phases"] + forward["phases"],
        "OOM in forward caught and retried": forward["first_oom_in"] == "forward",
        f"gradients within {RTOL:g} of the full batch's": max(
            backward["gradient_relative_error"], forward["gradient_relative_error"]
        )
        <= RTOL,
        "failed attempt freed before the retry (30k containers)": not forward["failed_tensor_alive_at_retry"]
        and forward["allocated_at_retry_over_start"] <= 0,
        "predicted: at most 1 OOM until settled": predicted["ooms_until_settled"] <= 1,
        "predicted: no OOM after settling": predicted["ooms_after_settled"] == 0,
        f"predicted: gradient within {RTOL:g}": predicted["gradient_relative_error"] <= RTOL,
        "user's peak kept after a probed step": predicted["user_peak_after_step"] >= predicted["user_peak"],
        "memory taken by another process: capacity fell, adapted, last step without OOM": predicted[
            "capacity_with_another_process"
        ]
        < predicted["capacity_before_another_process"]
        and predicted["ooms_in_the_last_step_then"] == 0,
        "disguised OOMs taken for OOMs, NCCL's own named": all(row[3] != "False" for row in disguised),
        f"one-rank DDP: OOM voted, retried, gradient within {RTOL:g}": ddp["ooms"] >= 1
        and ddp["gradient_relative_error"] <= RTOL,
        f"FSDP2 per module, one rank: retried, gradient within {RTOL:g}": fsdp["ooms"] >= 1
        and fsdp["gradient_relative_error"] <= RTOL,
        "settled plan within 10% of the best fixed microbatch size": speed["ratio"] >= 0.9,
    }
    mib = 1 << 20
    rows: list[list[Any]] = [
        [allocator, "OOMs (where) / split, cap under the full step's", f"{backward['ooms']} "
         f"({' '.join(backward['phases'])}) / {backward['split_count']}"],
        [allocator, "OOMs (where) / split, cap under its forward's", f"{forward['ooms']} "
         f"({' '.join(forward['phases'])}) / {forward['split_count']}"],
        [allocator, "gradient relative error, backward / forward",
         f"{backward['gradient_relative_error']:.1e} / {forward['gradient_relative_error']:.1e}"],
        [allocator, "at the retry: failed tensor alive, allocated - start (bytes)",
         f"{forward['failed_tensor_alive_at_retry']}, {forward['allocated_at_retry_over_start']}"],
        [allocator, "reserved - allocated at each OOM (MiB)",
         " ".join(f"{s / mib:.1f}" for s in backward["slack_at_ooms"] + forward["slack_at_ooms"]
                  + predicted["slack_at_ooms"]) or "-"],
        [allocator, "predicted: counts per step", " ".join(str(c) for c in predicted["counts"])],
        [allocator, "predicted: OOMs until settled / after",
         f"{predicted['ooms_until_settled']} / {predicted['ooms_after_settled']}"],
        [allocator, "user's peak before / reported after a probed step (MiB)",
         f"{predicted['user_peak'] / mib:.1f} / {predicted['user_peak_after_step'] / mib:.1f}"],
        [allocator, "another process took memory: capacity before / then (MiB), OOMs, then in the last step",
         f"{predicted['capacity_before_another_process'] / mib:.0f} / "
         f"{predicted['capacity_with_another_process'] / mib:.0f}, "
         f"{predicted['ooms_after_another_process']}, {predicted['ooms_in_the_last_step_then']}"],
    ]  # fmt: skip
    rows += [
        [allocator, f"one-rank {name}: OOMs / split, gradient relative error",
         f"{r['ooms']} / {r['split_count']}, {r['gradient_relative_error']:.1e}"]
        for name, r in (("DDP", ddp), ("FSDP2 per module", fsdp))
    ]  # fmt: skip
    sweep = " ".join(f"{k}:{v:.0f}" for k, v in speed["sweep_samples_per_s"].items()) or "-"
    rates = f"{speed['settled_split']}: {speed['settled_samples_per_s']:.0f}; {sweep}; {speed['ratio']:.2f}"
    rows.append([allocator, "samples/s: settled split, then fixed splits (count:rate), ratio to the best", rates])
    rows += [
        [allocator, f"{name}: type, is_oom_error", f"{kind}, {oom} {message!r}"]
        for name, kind, message, oom in disguised
    ]
    record = {
        "allocator": allocator, "backward": backward, "forward": forward, "predicted": predicted,
        "ddp": ddp, "fsdp2": fsdp, "throughput": speed,
    }  # fmt: skip
    return checks, rows, record


def _one(allocator: str, stand_in: bool) -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = _stand_in(allocator) if stand_in else _cuda()
    sizes = STAND_IN_SIZES[allocator] if stand_in else GPU_SIZES
    checks, rows, record = run_checks(dev, sizes, allocator)
    print(table(["allocator", "what", "value"], rows))
    for name, ok in checks.items():
        print(f"{'ok    ' if ok else 'FAILED'} [{allocator}] {name}")
    emit({"benchmark": "gpu_check", "stand_in": stand_in, "checks": checks, **record})
    gc.collect()
    return 0 if all(checks.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stand-in", action="store_true", help="run on a CPU against StandInCuda")
    parser.add_argument("--allocator", choices=list(ALLOCATORS), help="one allocator, in this process")
    args = parser.parse_args(argv)
    if args.allocator is not None:
        return _one(args.allocator, args.stand_in)
    if args.stand_in:
        return max(_one(allocator, True) for allocator in ALLOCATORS)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here, nothing to check (--stand-in runs it on a CPU)")
        return 0
    status = 0
    for allocator, conf in ALLOCATORS.items():  # each allocator in its own process: the setting is read once
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
        status |= subprocess.run([sys.executable, __file__, "--allocator", allocator], env=env).returncode
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())

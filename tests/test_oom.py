"""OOM detection (``is_oom_error``) and memory release after a failed attempt."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn

import elastic_batches as eb
from elastic_batches.oom import Status, is_nccl_oom, release_memory, status_of
from elastic_batches.testing import MemoryBudget, inject_oom

# Messages as the backends print them (RuntimeError, or a RuntimeError subclass in newer torch).
OOM_MESSAGES = {
    "cuda-allocator": "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity; 13.1 GiB "
    "already allocated; 1.2 GiB free; 14.0 GiB reserved in total by PyTorch)",
    "cuda-driver": "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API "
    "call, so the stacktrace below might be incorrect.",
    "hip-allocator": "HIP out of memory. Tried to allocate 512.00 MiB (GPU 0; 63.98 GiB total capacity)",
    "hip-runtime": "HIP error: hipErrorOutOfMemory",
    "xpu": "XPU out of memory. Tried to allocate 1.00 GiB (GPU 0; 15.11 GiB total capacity)",
    "mps": "MPS backend out of memory (MPS allocated: 17.01 GB, other allocations: 1.2 MB, max allowed: 18.13 GB). "
    "Tried to allocate 256 MB on private pool.",
    "cpu-allocator": "[enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: can't allocate memory: you tried "
    "to allocate 137438953472 bytes. Error code 12 (Cannot allocate memory)",
    "cublas": "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cudnn-alloc": "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "cudnn-workspace": "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "cuda-driver-api": "CUDA driver error: out of memory",
    "cufft": "cuFFT error: CUFFT_ALLOC_FAILED",
    "cusolver": "cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`. If you keep "
    "seeing this error, you may use `torch.backends.cuda.preferred_linalg_library()` to try linear algebra operators "
    "with other supported backends.",
    "cudnn9-host": "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
    "cudnn9-device": "cuDNN Frontend error: [cudnn_frontend] Error: "
    "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
    "hpu-device": "Device out of memory. Tried to allocate 4.00 GiB",
    "hpu-devmem": "synStatus=26 [Out of memory] PT_DEVMEM Allocation failed",
}


NCCL_OOM = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3375, unhandled cuda error (run with "
    "NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function failed.\n"
    "Last error:\nCuda failure 'out of memory'"
)


@pytest.mark.parametrize("message", list(OOM_MESSAGES.values()), ids=list(OOM_MESSAGES))
def test_documented_runtime_error_messages_are_oom(message: str) -> None:
    assert eb.is_oom_error(RuntimeError(message))


ACCELERATOR_OOMS = ["cuda-driver", "cuda-driver-api", "cublas", "cufft", "cusolver", "cudnn-alloc", "cudnn9-device"]


@pytest.mark.parametrize("message", [OOM_MESSAGES[name] for name in ACCELERATOR_OOMS], ids=ACCELERATOR_OOMS)
def test_accelerator_error_with_an_oom_message_is_oom(message: str) -> None:
    # torch >= 2.8 raises CUDA runtime errors (C10_CUDA_CHECK) as torch.AcceleratorError, a RuntimeError subclass.
    accelerator_error = getattr(torch, "AcceleratorError", RuntimeError)
    assert eb.is_oom_error(accelerator_error(message))


@pytest.mark.parametrize(
    "make",  # built in the test: error objects held by the collected parameters would outlive it
    [
        lambda: torch.OutOfMemoryError("anything at all"),
        lambda: torch.OutOfMemoryError(),
        lambda: eb.ElasticOOMError("out of memory even at microbatch size 1"),
    ],
    ids=["torch-oom", "torch-oom-no-message", "elastic-oom"],
)
def test_out_of_memory_error_type_is_oom(make: Callable[[], BaseException]) -> None:
    assert eb.is_oom_error(make())


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA error: unspecified launch failure"),
        RuntimeError(
            "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k)`"
        ),
        RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"),
        RuntimeError(NCCL_OOM),
        RuntimeError(
            "Trying to backward through the graph a second time (or directly access saved tensors after "
            "they have already been freed). Saved intermediate values of the graph are freed"
        ),
        RuntimeError("memory format channels_last is not supported for this op"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 2x2)"),
        RuntimeError("Expected all tensors to be on the same device, but found at least two devices"),
        RuntimeError("shared memory segment is too small for the DataLoader worker"),
        ValueError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        TypeError("DefaultCPUAllocator: can't allocate memory"),
        KeyError("CUDA out of memory"),
        Exception("out of memory"),
        KeyboardInterrupt(),
    ],
    ids=[
        "illegal-memory-access",
        "launch-failure",
        "cublas-execution-failed",
        "cudnn-execution-failed",
        "nccl-oom",
        "graph-freed",
        "memory-format",
        "shape-mismatch",
        "device-mismatch",
        "shared-memory",
        "value-error-with-oom-text",
        "type-error-with-oom-text",
        "key-error-with-oom-text",
        "plain-exception",
        "keyboard-interrupt",
    ],
)
def test_other_errors_are_not_oom(exc: BaseException) -> None:
    assert not eb.is_oom_error(exc)


@pytest.mark.parametrize(
    "message",
    [
        NCCL_OOM,
        "NCCL error in: ProcessGroupNCCL.cpp:1970, internal error - please report this issue to the NCCL "
        "developers, NCCL version 2.21.5\nncclInternalError: Internal check failed.\nLast error:\nFailed to CUDA "
        "calloc async 24 bytes",
    ],
    ids=["unhandled-cuda-error", "calloc"],
)
def test_nccl_out_of_memory_is_an_error_that_names_its_cause(message: str) -> None:
    error = torch.distributed.DistBackendError(message)
    assert is_nccl_oom(error) and not eb.is_oom_error(error)
    assert status_of(error) == Status.ERROR
    assert status_of(error) == Status.ERROR  # the note is added once
    assert error.__notes__ == [error.__notes__[0]]
    assert "NCCL itself ran out of device memory" in error.__notes__[0]
    assert "not safe to use again" in error.__notes__[0]


def test_a_caching_allocator_oom_in_a_collective_is_an_ordinary_oom() -> None:
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (all_reduce output, NCCL)")
    assert eb.is_oom_error(error) and not is_nccl_oom(error)


def test_nccl_errors_other_than_out_of_memory_are_not_nccl_oom() -> None:
    error = torch.distributed.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:3375, remote process exited")
    assert not is_nccl_oom(error) and status_of(error) == Status.ERROR and not hasattr(error, "__notes__")


# ---------------------------------------------------------------------------------------------
# Memory release


def test_release_memory_clears_the_frames_of_the_traceback_and_its_chain() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []

    def inner() -> None:
        activation = torch.ones(1000)
        refs.append(weakref.ref(activation))
        raise torch.OutOfMemoryError("CUDA out of memory")

    def outer() -> None:
        kept = torch.ones(1000)
        refs.append(weakref.ref(kept))
        try:
            inner()
        except torch.OutOfMemoryError as err:
            raise RuntimeError("wrapped") from err

    try:
        outer()
    except RuntimeError as err:
        error = err
    gc.collect()
    assert all(ref() is not None for ref in refs)  # the traceback keeps both frames' tensors alive
    release_memory(error)
    assert [ref() for ref in refs] == [None, None]
    assert error.__traceback__ is not None  # the traceback lines are kept


def test_release_memory_without_an_exception_collects_young_cycles_holding_tensors() -> None:
    class Node:
        pass

    node = Node()
    node.self, node.activation = node, torch.ones(1024)  # a reference cycle only the collector frees
    alive = weakref.ref(node.activation)
    del node
    release_memory(None)
    assert alive() is None


def _train_with_a_retry() -> tuple[weakref.ref[nn.Module], int]:
    """A step that retries once (an OOM the loss raises), then evaluates; a weak reference to its model."""
    model = _model()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    calls = 0

    def loss_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (raised by the test)")
        return (model(mb[0]) - mb[1]).pow(2).mean()

    step.backward((torch.randn(8, 4), torch.randn(8, 1)), loss_fn)
    step.evaluate(torch.randn(8, 4), model)
    return weakref.ref(model), step.controller.retry_count


def test_a_dropped_step_frees_its_model_by_reference_counting_alone() -> None:
    """No cycle through the step: its model (on a GPU, its memory) goes with the last reference, not at a collection."""
    gc.collect()
    gc.disable()
    try:
        alive, retries = _train_with_a_retry()
        assert retries == 1 and alive() is None
    finally:
        gc.enable()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


@pytest.mark.parametrize("phase", ["forward", "backward"], ids=["oom-in-forward", "oom-in-backward"])
def test_no_reference_to_the_failed_microbatch_survives_a_retry(phase: str) -> None:
    model = _model()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    refs: list[weakref.ref[torch.Tensor]] = []

    def loss_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden = model[1](model[0](mb[0] * 1.0))  # a tensor made in loss_fn, saved for backward
        refs.append(weakref.ref(hidden))
        return (model[2](hidden) - mb[1]).pow(2).mean()

    batch = (torch.randn(8, 4), torch.randn(8, 1))
    with inject_oom(model[2] if phase == "forward" else model[0], phase=phase, calls=1) as oom:
        step.backward(batch, loss_fn)
    assert oom.fired == 1 and step.controller.retry_count == 1
    failed_attempt = refs[:2]  # microbatches 0 and 1 of the first attempt (2 microbatches)
    assert len(refs) == 2 + 4  # then 4 microbatches on the retry
    assert [ref() for ref in failed_attempt] == [None, None]


def test_no_reference_to_the_failed_microbatch_survives_an_evaluate_retry() -> None:
    model = _model()
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
    refs: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        hidden = model[1](model[0](x))
        refs.append(weakref.ref(hidden))
        return model[2](hidden)

    x = torch.randn(8, 4)
    with torch.no_grad(), inject_oom(model[2], phase="forward", calls=1):
        outputs = step.evaluate(x, fn)
    assert torch.allclose(torch.cat(outputs), model(x))
    assert len(refs) == 2 + 4 and [ref() for ref in refs[:2]] == [None, None]


def _containers(count: int) -> list[list[int]]:
    """``count`` short-lived containers: enough make the collector promote what is alive to its oldest generation."""
    return [[index] for index in range(count)]


@pytest.mark.parametrize("containers", [0, 30_000, 200_000], ids=["0-containers", "30k-containers", "200k-containers"])
@pytest.mark.parametrize("probe", [False, True], ids=["no-probe", "probe"])
@pytest.mark.parametrize("where", ["backward", "evaluate"])
def test_the_failed_microbatch_is_freed_before_the_retry_first_forward(
    containers: int, probe: bool, where: str
) -> None:
    model = _model()
    memory = MemoryBudget(limit_bytes=1 << 30) if probe else None  # a probe with a limit measures every attempt
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2), memory=memory)
    made: list[weakref.ref[torch.Tensor]] = []
    alive_at_retry: list[bool] = []

    def loss_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if made and not alive_at_retry:
            alive_at_retry.append(made[0]() is not None)
        loss = (model(mb[0]) - mb[1]).pow(2).mean()
        if not made and len(mb[0]) >= 4:
            activation = model[0](mb[0]) * 2.0
            made.append(weakref.ref(activation))
            junk = _containers(containers)
            raise torch.OutOfMemoryError(f"CUDA out of memory (test, {len(junk)} containers)")
        return loss

    batch = (torch.randn(16, 4), torch.randn(16, 1))
    if where == "backward":
        step.backward(batch, loss_fn)
    else:
        with torch.no_grad():
            step.evaluate(batch, loss_fn)
    assert made and alive_at_retry == [False]

"""OOM detection (``is_oom_error``) and memory release after a failed attempt."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn

import elastic_batches as eb
from elastic_batches.oom import release_memory
from elastic_batches.testing import inject_oom

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
    "hpu-device": "Device out of memory. Tried to allocate 4.00 GiB",
    "hpu-devmem": "synStatus=26 [Out of memory] PT_DEVMEM Allocation failed",
}


@pytest.mark.parametrize("message", list(OOM_MESSAGES.values()), ids=list(OOM_MESSAGES))
def test_documented_runtime_error_messages_are_oom(message: str) -> None:
    assert eb.is_oom_error(RuntimeError(message))


@pytest.mark.parametrize(
    "message", [OOM_MESSAGES["cuda-driver"], OOM_MESSAGES["cublas"]], ids=["cuda-driver", "cublas"]
)
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

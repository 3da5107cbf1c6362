"""Simulated device memory and OOM injection, for testing elastic batching on a CPU.

The first two raise the real :class:`torch.OutOfMemoryError`, so the code under test takes the
same path it takes on a GPU:

* :class:`MemoryBudget` counts the bytes of the tensor storages that ops allocate while it is
  active and raises once they would pass a limit. Memory grows with batch size and sequence
  length as on a device, because storages are tracked until they are freed, including the
  activations that autograd keeps for backward.
* :func:`inject_oom`, :func:`inject_oom_in_optimizer` and :func:`inject_oom_in_transfer` raise
  at an exact, chosen point: a forward call, the backward of a forward call, an optimizer step
  or the device transfer of a microbatch, optionally on one ``torch.distributed`` rank only;
  :func:`inject_oom_in_cut` and :func:`inject_oom_in_op` strike in the cut of a padded
  microbatch and in any chosen aten operator (a concatenation, a stack, a buffer's allocation);
  :func:`inject_oom_in_all_gather` and :func:`inject_oom_in_reduce_scatter` in the allocation
  of an FSDP2 collective's buffer, :func:`inject_oom_in_stand_in` in that of the buffer a rank
  stands in for its script's collectives with.
* :class:`StandInCuda` stands in for ``torch.cuda``'s memory functions on a CPU, over a
  ``MemoryBudget`` with the caching-allocator model, checking their arguments as the real ones.
* :class:`AddressSpaceLimit` makes the real CPU allocator refuse (Linux): a limit on the
  process's address space, under which torch raises its own ``DefaultCPUAllocator: can't
  allocate memory``.

The module imports no Lightning (nor transformers). The project's own harness (the rank pools,
the fault-injection matrix, the tiny Hugging Face clients) is not installed: it lives in the
repository's ``tests/support/``, and the demo's model in :mod:`elastic_batches.demo_model`.

See ``docs/testing.md`` for a walk-through.
"""

from elastic_batches.testing.address_space import AddressSpaceLimit, address_space_bytes
from elastic_batches.testing.collectives import (
    inject_oom_in_all_gather,
    inject_oom_in_reduce_scatter,
    inject_oom_in_stand_in,
)
from elastic_batches.testing.cuda import StandInCuda
from elastic_batches.testing.injection import (
    OOMInjection,
    inject_oom,
    inject_oom_in_cut,
    inject_oom_in_op,
    inject_oom_in_optimizer,
    inject_oom_in_transfer,
)
from elastic_batches.testing.memory import MemoryBudget

__all__ = [
    "AddressSpaceLimit",
    "MemoryBudget",
    "OOMInjection",
    "StandInCuda",
    "address_space_bytes",
    "inject_oom",
    "inject_oom_in_all_gather",
    "inject_oom_in_cut",
    "inject_oom_in_op",
    "inject_oom_in_optimizer",
    "inject_oom_in_reduce_scatter",
    "inject_oom_in_stand_in",
    "inject_oom_in_transfer",
]

"""How a vote travels: as bytes inside a sum, in buffers written by the host, and the unused-parameter count.

A fused vote carries each rank's five float64 as their 40 bytes, one byte (0..255) per element
of a collective of another dtype (the gradients'): exact in any of :data:`BYTE_CARRIERS`, and
exact in a sum where the other ranks add 0. Everything a vote sends is allocated before the
attempt it reports on, so that a vote never allocates (an OOM in it would strand the peers).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch
import torch.distributed as dist

from elastic_batches.distributed.protocol import Rows
from elastic_batches.oom import Status

__all__ = ["ALL_GATHER", "BYTE_CARRIERS", "REDUCE_SCATTER", "VOTE_BYTES", "HostWritten", "UsedMap", "VoteBytes"]

# status, size, total, whether a trained parameter got no gradient here, and the largest microbatch this rank's
# memory model predicts fits: an attempt's vote
VOTE_VALUES = 5
VOTE_BYTES = 8 * VOTE_VALUES
_VOTE_STRUCT = struct.Struct(f"{VOTE_VALUES}d")
BYTE_CARRIERS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The vote's all-gather and the gradients' reduce-scatter under torch's current names where it has them (the
# older all_gather_into_tensor and reduce_scatter_tensor warn); looked up at each call, so that a test can count them.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


class VoteBytes:
    """A vote that rides in a sum: this rank's values as bytes in its slot, every rank's values read from the sum.

    Each rank owns ``VOTE_BYTES`` elements, one byte (0..255) of its five float64 per element;
    the others add zeros there, so the sum holds every rank's bytes exactly. A steady run casts
    the same vote step after step: the slots are written again only when this rank's bytes
    change, and the sum is decoded again only when it differs from the last one decoded. The
    comparison runs on the host: a vote may follow an attempt that filled the device, so
    nothing here allocates there.

    Args:
        rank: This rank.
        world: The number of ranks.
        dtype: The dtype of the collective that carries the vote (one of :data:`BYTE_CARRIERS`).
    """

    def __init__(self, rank: int, world: int, dtype: torch.dtype) -> None:
        self.rank, self.world = rank, world
        self.host = torch.zeros(world * VOTE_BYTES, dtype=dtype)  # this rank's slot, zeros in the others'
        self._written = b""
        self._received = torch.zeros(world * VOTE_BYTES, dtype=dtype)  # the sum, copied to the host
        self._decoded = torch.zeros(world * VOTE_BYTES, dtype=dtype)  # the last sum decoded
        self._every_vote = struct.Struct(f"{world * VOTE_VALUES}d")
        self._rows: Rows | None = None

    def slots(self, values: Sequence[float]) -> torch.Tensor:
        """The host tensor to send: ``values`` (status, size, total, unused flag, capacity) in this rank's slot."""
        packed = _VOTE_STRUCT.pack(*values)
        if packed != self._written:
            slots = bytearray(self.world * VOTE_BYTES)  # writable, as torch.frombuffer wants
            slots[self.rank * VOTE_BYTES : (self.rank + 1) * VOTE_BYTES] = packed
            self.host.copy_(torch.frombuffer(slots, dtype=torch.uint8))
            self._written = packed
        return self.host

    def read(self, summed: torch.Tensor) -> Rows:
        """Every rank's vote values from the summed slots."""
        if summed.device.type != "cpu":
            self._received.copy_(summed)
            summed = self._received
        if self._rows is None or not torch.equal(summed, self._decoded):
            values = self._every_vote.unpack(bytes(map(round, summed.tolist())))
            self._rows = tuple(values[r * VOTE_VALUES : (r + 1) * VOTE_VALUES] for r in range(self.world))
            self._decoded.copy_(summed)
        return self._rows


class HostWritten:
    """A tensor on the collectives' device that the host fills without a dispatched op, so nothing is allocated.

    Allocated once, before any collective that sends it: writing it later cannot raise an OOM.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel = numel
        self._host = torch.zeros(numel, dtype=dtype)
        self._device = self._host if device.type == "cpu" else self._host.to(device)

    def write(self, values: Sequence[float]) -> torch.Tensor:
        """``values`` first, zeros after; the tensor on the device, to send."""
        host = self._host.numpy()
        host[: len(values)] = values
        host[len(values) :] = 0
        if self._device is not self._host:
            self._device.copy_(self._host)
        return self._device


class UsedMap:
    """Which trained parameters got a gradient on no rank: those keep ``grad=None``, as in plain DDP or one process.

    Every rank reduces the same tensors, so a rank zero-fills the gradient of a parameter its
    microbatches did not use. A single process (and DDP with ``find_unused_parameters``) leaves
    the gradient of a parameter that no rank used ``None``; an optimizer skips a ``None`` gradient
    but moves and decays a parameter with a zero one. Each rank's vote says whether it left a
    parameter unused; only then, after the reduction, one more small all-reduce (a count per
    parameter, allocated before the vote) tells every rank which parameters no rank used.
    """

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None) -> None:
        self.device, self.group = device, group
        self.used: list[bool] | None = None  # this attempt's, in the order of the reduced parameters
        self.somewhere = False  # the vote's news: some rank left a parameter without gradient
        self._counts: HostWritten | None = None

    def record(self, used: list[bool]) -> None:
        """Before the vote: which parameters got a gradient here; allocates the counts when their number changes."""
        if self._counts is None or self._counts.numel != len(used):
            self._counts = None  # free the old ones first
            self._counts = HostWritten(len(used), torch.float32, self.device)
        self.used = used

    @property
    def flag(self) -> float:
        """This rank's vote value (at index 3 of its row): 1 if it left a parameter unused."""
        return float(self.used is not None and not all(self.used))

    def learn(self, status: Status, rows: Sequence[Sequence[float]]) -> None:
        """From every rank's vote: whether an attempt that fitted left some parameter unused on some rank."""
        self.somewhere = status == Status.OK and any(r[3] for r in rows)

    def reset(self) -> None:
        self.used, self.somewhere = None, False

    def unused_everywhere(self) -> set[int]:
        """After the reduction, on every rank: the parameters no rank used (one all-reduce, if the vote said so)."""
        assert self.used is not None and self._counts is not None
        if not self.somewhere:
            return set()
        counts = self._counts.write(self.used)
        dist.all_reduce(counts, group=self.group)
        return {index for index, count in enumerate(counts.tolist()) if count == 0}

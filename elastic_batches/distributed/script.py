"""The collective script: an attempt's FSDP2 collectives, known in advance, so that a failed rank can stand in for them.

Guarding every FSDP2 collective with a round of the side channel (``guard.py``) costs a host
round trip each. But an attempt runs the collectives the last attempt of its kind (backward or
forward only) and microbatch count ran, in the same order, on every rank. Once two such
attempts in a row ran the same sequence, as every rank says at their votes, the sequence is
that kind's *script*, and an attempt with a script runs no guard round at all. A rank whose
attempt fails *stands in* for the collectives its peers still start: the rest of the script,
through the same comms, on the same groups, with the same dtypes and reduce ops, sending zeros
from one buffer per dtype of the largest size the rest needs, allocated once (its share of that
attempt is discarded with the rest). Then every rank is at the vote, which fails. A rank that
cannot allocate that buffer votes :data:`STAND_IN_FAILED`: its peers wait in the collective it
does not start until their process group times out, and every rank raises at the vote.

A rank about to start a collective other than the script's, or done with its microbatches
before the script is, leaves the attempt there (``ScriptDeparture``) and stands in for the rest
of the script too: every rank meets that point alike (FSDP2 starts the same collectives on every
rank), so a rank that failed before it, standing in for the script, is matched. The vote says
so, the attempt is void and tried again guarded, and the model gets no script again: a model
whose modules run depending on the data is guarded collective by collective.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ALL_GATHER_OP", "DEPARTED", "REDUCE_SCATTER_OP", "STAND_IN_FAILED", "Collective", "Script", "Scripts"]

ALL_GATHER_OP, REDUCE_SCATTER_OP = 1.0, 2.0  # a collective's kind, as a guard round carries it
DEPARTED = -1.0  # what a rank votes when its attempt left its script
STAND_IN_FAILED = -2.0  # what a rank votes when it could not stand in for its script (out of memory)


@dataclass(frozen=True)
class Collective:
    """One FSDP2 collective as recorded: what every rank must start to complete it, and how to start it again.

    Two collectives are equal when a peer could not tell one from the other: the same kind, size,
    dtype, device type, FSDP2 unit and group sizes. Groups are compared by size, so that the
    ranks of different HSDP shard groups record the same script.
    """

    op: float  # ALL_GATHER_OP or REDUCE_SCATTER_OP
    numel: int  # all-gather: output elements; reduce-scatter: input elements
    dtype: torch.dtype
    device_type: str
    unit: int  # the FSDP2 parameter group's index in the model
    world: int  # the group's size
    replicas: int  # HSDP: the replicate group's size, all-reduced after a reduce-scatter (0: none)
    comm: Any = field(compare=False)  # the comm FSDP2 had: the user's, or its default
    group: Any = field(compare=False)
    replicate: Any = field(compare=False)
    device: torch.device = field(compare=False)
    reduce_op: Any = field(compare=False, default=None)  # the reduce-scatter's op, as FSDP2 passed it
    all_reduce_op: Any = field(compare=False, default=None)  # HSDP: the op of FSDP2's all-reduce after it
    name: str = field(compare=False, default="")  # the unit's module name(s), for messages

    @functools.cached_property
    def signature(self) -> str:
        """The fields peers compare, as text (hashed into a script's digest); made once per record."""
        return f"{self.op}/{self.numel}/{self.dtype}/{self.device_type}/{self.unit}/{self.world}/{self.replicas}"

    @property
    def buffer_numel(self) -> int:
        """Elements a stand-in needs: the all-gather's output, or the reduce-scatter's input and output."""
        return self.numel if self.op == ALL_GATHER_OP else self.numel + self.numel // self.world

    def describe(self) -> str:
        """``"all-gather of 96 torch.float32 elements of unit 2 ('layers.1')"``: the collective, for messages."""
        kind = "all-gather" if self.op == ALL_GATHER_OP else "reduce-scatter"
        return f"{kind} of {self.numel} {self.dtype} elements of unit {self.unit} ({self.name or 'the root'!r})"

    def stand_in(self, buffer: torch.Tensor) -> None:
        """Start this collective from ``buffer`` (:attr:`buffer_numel` elements or more), in a failed rank's stead.

        Its peers complete theirs; what this rank sends is zeros. The reduce-scatter (and HSDP's
        all-reduce after it) uses the op FSDP2 used, on the same groups.
        """
        world = self.world
        if self.op == ALL_GATHER_OP:
            output = buffer[: self.numel]
            chunk = self.numel // world
            mine = output.narrow(0, dist.get_rank(self.group) * chunk, chunk).zero_()
            self.comm(output_tensor=output, input_tensor=mine, group=self.group, async_op=False)
            return
        sent = buffer[: self.numel].zero_()
        received = buffer[self.numel : self.numel + self.numel // world]
        self.comm(output_tensor=received, input_tensor=sent, group=self.group, op=self.reduce_op, async_op=False)
        if self.replicate is not None:
            op = self.all_reduce_op if self.all_reduce_op is not None else dist.ReduceOp.SUM
            dist.all_reduce(received, group=self.replicate, op=op)


@dataclass(frozen=True)
class Script:
    """Every collective of an attempt, in order."""

    collectives: tuple[Collective, ...]

    def __len__(self) -> int:
        return len(self.collectives)

    def buffers(self, start: int) -> dict[tuple[torch.dtype, torch.device], torch.Tensor]:
        """The stand-ins' buffers for the collectives from ``start`` on: one per dtype and device, allocated once.

        Each is as large as the largest of those collectives needs (:attr:`Collective.buffer_numel`),
        allocated by that collective's comm (FSDP2's default, or the user's: a comm with memory of
        its own, symmetric memory, serves it).
        """
        largest: dict[tuple[torch.dtype, torch.device], Collective] = {}
        for c in self.collectives[start:]:
            key = (c.dtype, torch.device(c.device))
            if key not in largest or c.buffer_numel > largest[key].buffer_numel:
                largest[key] = c
        return {key: c.comm.allocate((c.buffer_numel,), dtype=key[0], device=key[1]) for key, c in largest.items()}

    @property
    def digest(self) -> float:
        """A positive integer below 2**48 (exact in a float64) that tells scripts apart on every rank alike."""
        text = ";".join(c.signature for c in self.collectives)
        return float(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=6).digest(), "big") | 1)


class Scripts:
    """A model's scripts by attempt kind, and the rule by which every rank adopts one at the same vote.

    An attempt's key is ``(where, count)``, or ``None`` when it has none (its microbatches are
    measured as they go, so their count is not known in advance). A key's recorded sequence
    becomes its script when the votes of two consecutive attempts of that key agree on it,
    every rank voting the same digest; a rank voting :data:`DEPARTED` drops every script for good.
    """

    def __init__(self) -> None:
        self.enabled = True
        self._seen: dict[Hashable, float] = {}  # key -> the digest its last complete attempt agreed on
        self._scripts: dict[Hashable, Script] = {}

    def script(self, key: Hashable | None) -> Script | None:
        """The script of an attempt with ``key``, or ``None`` (every collective guarded)."""
        return None if key is None or not self.enabled else self._scripts.get(key)

    def report(self, key: Hashable | None, departed: bool, recorded: Script | None, failed: bool = False) -> float:
        """What this rank votes: :data:`STAND_IN_FAILED` (``failed``), :data:`DEPARTED`, a digest, or 0.

        The digest is that of a complete attempt's ``recorded`` sequence; 0 where nothing is
        learned: scripts off, or an attempt without a key.
        """
        if failed:
            return STAND_IN_FAILED
        if departed:
            return DEPARTED
        if not self.enabled or key is None or recorded is None or not len(recorded):
            return 0.0
        return recorded.digest

    def agree(self, key: Hashable | None, reports: Sequence[float], recorded: Script | None) -> None:
        """After a vote: adopt ``recorded`` as ``key``'s script, keep what is known, or drop every script."""
        if not self.enabled or key is None or STAND_IN_FAILED in reports:
            return
        if DEPARTED in reports:
            self.enabled = False
            self._scripts.clear()
            return
        digest = reports[0]
        if not digest or any(r != digest for r in reports) or recorded is None:
            return  # an attempt some rank did not complete: nothing learned
        if self._seen.get(key) == digest:
            self._scripts[key] = recorded
        else:
            self._seen[key] = digest
            self._scripts.pop(key, None)

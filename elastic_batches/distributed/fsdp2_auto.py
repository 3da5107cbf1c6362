"""FSDP2 ``gather="auto"``: gathered once an attempt while the gathered model leaves room, per module otherwise.

The rule, the same on every rank (every switch follows a vote):

1. Before each attempt gathered once, the gather check reserves twice what gathering once holds
   beyond FSDP2's own memory (the unsharded parameters and their unsharded gradients), plus one
   all-gather buffer. If some rank cannot, the step gathers per module from then on (for good:
   memory that was short once, with an optimizer's state allocated, stays short).
2. An attempt gathered once that runs out of memory at the smallest microbatch the controller
   allows (where ``gather="attempt"`` would raise ``ElasticOOMError``) switches to per-module
   gathering too, and the batch is tried again with what the controller learned forgotten:
   per-module gathering holds FSDP2's own memory, so a model that trains under FSDP2's own
   recipe at some microbatch size never fails here.

Gathering once is faster where it fits (one all-gather per module an attempt instead of two per
module and microbatch, one reduce-scatter an attempt instead of one per module and microbatch);
``docs/distributed.md`` gives the measured speed and memory of both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from elastic_batches.distributed.fsdp2 import FSDPLayout, FullyShard
from elastic_batches.distributed.fsdp2_modules import ShardPerModule
from elastic_batches.distributed.guard import CollectiveGuard
from elastic_batches.distributed.protocol import Ballot, GradientSync, Verdict
from elastic_batches.oom import Status
from elastic_batches.plan import Plan

__all__ = ["AUTO_HEADROOM", "AutoGather"]

AUTO_HEADROOM = 2.0  # gather once when the unsharded parameters and gradients fit this many times


class AutoGather(GradientSync):
    """FSDP2 with ``gather="auto"``: :class:`FullyShard` while the rule allows, then :class:`ShardPerModule`.

    Args:
        model: The root FSDP2 module.
        once: The gather-once scheme, or ``None`` when the layout allows none (per module from
            the start).
        per_module: The per-module scheme (sharing ``once``'s guard).

    Attributes:
        active: The scheme the next attempt uses.
    """

    replicated = False

    def __init__(self, model: nn.Module, once: FullyShard | None, per_module: ShardPerModule) -> None:
        super().__init__(model)
        self.once, self.per_module = once, per_module
        self.active: FullyShard | ShardPerModule = once if once is not None else per_module

    @classmethod
    def of(cls, model: nn.Module, **options: int) -> AutoGather:
        """Both schemes of ``model`` over one layout and one guard (``options``: :class:`FullyShard`'s)."""
        layout = FSDPLayout(model)
        guard = CollectiveGuard(layout.side_channel())
        try:
            once: FullyShard | None = FullyShard(model, layout=layout, guard=guard, headroom=AUTO_HEADROOM, **options)
        except NotImplementedError:  # a layout gathering once cannot reduce (shard_placement_fn): per module
            once = None
        return cls(model, once, ShardPerModule(model, layout=layout, guard=guard))

    @property
    def gathers_once(self) -> bool:
        """Whether the next attempt gathers every module once (else per module)."""
        return self.active is self.once

    def _per_module_from_now(self) -> None:
        if self.once is not None:
            self.once.release()
        self.active = self.per_module

    def parameters(self) -> Iterable[nn.Parameter]:
        return self.active.parameters()

    def graph_leaf_ids(self) -> set[int]:
        return self.per_module.graph_leaf_ids()  # the same parameters, sharded and unsharded, in both

    def check_gather(self) -> Verdict:
        if self.once is None or self.active is not self.once:
            return self.per_module.check_gather()
        outcome = self.once.check_gather()
        if outcome.status != Status.OK:  # some rank cannot hold the gathered model twice: per module, on every rank
            self._per_module_from_now()
            return self.per_module.check_gather()
        return outcome

    def microbatches(self) -> contextlib.AbstractContextManager[None]:
        return self.active.microbatches()

    @property
    def pairs_microbatches(self) -> bool:
        return self.active.pairs_microbatches

    def agree_plan(self, plan: Plan, where: str = "backward") -> Plan:
        return self.active.agree_plan(plan, where)

    def agree_pieces(self, count: int, room: int) -> int:
        return self.active.agree_pieces(count, room)

    def weigh(self, total: float) -> None:
        self.active.weigh(total)

    def prepare(self, params: Sequence[torch.Tensor]) -> None:
        self.active.prepare(params)

    def vote(self, ballot: Ballot, params: Sequence[torch.Tensor] | None = None) -> Verdict:
        return self.active.vote(ballot, params)

    def agree(self, status: Status, *values: float) -> Verdict:
        return self.active.agree(status, *values)

    def discard(self) -> None:
        self.active.discard()

    def reduce(self, params: Sequence[torch.Tensor], scale: float) -> None:
        self.active.reduce(params, scale)

    def local_grad_sq_norm(self, grads: Sequence[torch.Tensor]) -> float:
        return self.active.local_grad_sq_norm(grads)

    def fall_back(self) -> bool:
        if self.active is not self.once:
            return False
        self._per_module_from_now()
        return True

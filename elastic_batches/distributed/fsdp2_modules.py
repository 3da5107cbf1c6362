"""FSDP2 (``fully_shard``), gathered per module: FSDP2's own memory profile, every collective guarded.

Every FSDP2 module all-gathers and reshards as the user configured it (``reshard_after_forward``,
prefetching, ``MixedPrecisionPolicy``), and every microbatch's backward reduce-scatters its
gradients into the sharded ``.grad``, which FSDP2 accumulates: FSDP2's own gradient-accumulation
recipe, whose memory it keeps. Each of those collectives is guarded (``guard.py``), and the
vote is the side channel's meeting point, so an OOM on one rank anywhere in a microbatch stops
every rank before its next collective. Once an attempt's collectives are known in advance (a
script, ``script.py``), none has a guard round before it: a rank that fails stands in for the
rest of them, so that its peers reach the vote; an attempt that leaves its script is void on
every rank and tried again, guarded.

Each rank's share of the global mean rides in the reduce-scatters: the guarded reduce-scatter
multiplies its input by ``divide x total_r / reference`` (``divide``: what FSDP2 divides the
sum by, the data-parallel size; ``reference``: the last vote's grand total, known alike on every
rank), so that the sharded gradients hold ``sum_r total_r * grad_r / reference``; after the vote
one multiplication by ``reference / sum_r total_r`` (none when the total did not change) makes
them the global mean.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from elastic_batches.distributed.fsdp2 import FSDPLayout
from elastic_batches.distributed.guard import PIECES_OP, CollectiveGuard, guarded_comms
from elastic_batches.distributed.protocol import Ballot, GradientSync, Verdict, agreement_of, check_values, verdict_of
from elastic_batches.distributed.script import DEPARTED, STAND_IN_FAILED, Scripts
from elastic_batches.oom import Status, release_memory
from elastic_batches.plan import Plan

__all__ = ["ShardPerModule"]


class ShardPerModule(GradientSync):
    """FSDP2 gathering per module, as FSDP2's own accumulation recipe does; every collective guarded or scripted.

    Memory: FSDP2's own, at the same microbatch size: parameters unsharded a module (or a
    prefetch) at a time, gradients reduce-scattered into the sharded ``.grad`` every microbatch.
    Nothing is kept for the run but the side channel's two small float64 tensors.

    Collectives, per microbatch: FSDP2's own (its all-gathers in forward and backward, a
    reduce-scatter per module in backward, HSDP's all-reduce after it), each after one guard
    round of the side channel (a gloo ``all_gather`` of 7 float64 per rank) until the attempt's
    kind has a script; then none. Per attempt, the plan's agreement and the vote (one more
    round each, or a few when a rank failed).

    Every rank must run the same number of microbatches through the same modules (as FSDP2's
    own recipe needs): a rank that would start a collective no peer starts raises instead, on
    every rank (scripted: in the guarded retry of the attempt that left its script).

    Args:
        model: The root FSDP2 module.
        layout: The model's :class:`FSDPLayout` (made from ``model`` by default).
        guard: The side channel's guard, shared with another scheme of the same model.

    Attributes:
        scripts: The scripts of the attempts' kinds (``scripts.enabled = False``: every collective
            guarded, for good).

    Raises:
        NotImplementedError: what :class:`FSDPLayout` refuses, or an HSDP mesh whose shard
            dimension has one rank.
    """

    replicated = False

    def __init__(self, model: nn.Module, *, layout: FSDPLayout | None = None, guard: CollectiveGuard | None = None):
        super().__init__(model)
        layout = layout if layout is not None else FSDPLayout(model)
        if layout.shard_world == 1 and layout.replicas > 1:
            raise NotImplementedError(
                "ElasticStep gathering per module needs an FSDP2 mesh whose shard dimension has several ranks; "
                f"got {layout.replicas} replicas of 1 shard (that is DDP: use DistributedDataParallel)"
            )
        self.layout = layout
        self.guard = guard if guard is not None else CollectiveGuard(layout.side_channel())
        self.world_size = layout.shard_world * layout.replicas
        self._reference = 1.0  # the last grand total that fitted: gradients are pre-scaled by total_r / reference
        self._share = 1.0  # this attempt's total_r / reference
        self._post: float | None = None  # after a vote that fitted: the factor still to apply
        self.scripts = Scripts()
        # A user's all-reduce hook may run collectives of its own, which no script records.
        self.scripts.enabled = all(group._all_reduce_hook is None for group in layout.groups)
        self._key: Hashable | None = None  # this attempt's script key

    def graph_leaf_ids(self) -> set[int]:
        # FSDP2's forward runs on the unsharded parameters, whose gradients it reduces into the sharded ones.
        return super().graph_leaf_ids() | self.layout.unsharded_ids()

    @property
    def pairs_microbatches(self) -> bool:
        return True

    # FSDP2's collectives pair the ranks' microbatches: every rank cuts as many (one side-channel round each).
    def agree_plan(self, plan: Plan, where: str = "backward") -> Plan:
        if self.guard.world_size > 1:
            rows = self.guard.agree(Status.OK, (float(plan.count), float(plan.lead)))
            plan = plan.amended(int(max(row[1] for row in rows)), int(min(row[2] for row in rows)))
        # A script per kind of attempt: backward or evaluate, with grad mode on or off, and microbatch count.
        self._key = (where, torch.is_grad_enabled(), plan.count) if not plan.lead else None  # measured: count unknown
        return plan

    def agree_pieces(self, count: int, room: int) -> int:
        if self.guard.world_size == 1:
            return count
        rows = self.guard.agree_within(PIECES_OP, (float(count), float(room)))
        return max(1, min(int(max(row[0] for row in rows)), int(min(row[1] for row in rows))))

    def weigh(self, total: float) -> None:
        self._share = total / self._reference if self.world_size > 1 else 1.0

    def _factor(self, group: Any) -> Callable[[], float]:
        """The multiplier of ``group``'s reduce-scatter input: FSDP2 divides the sum by ``divide``."""
        divide = group.gradient_divide_factor or float(self.world_size)
        return lambda: divide * self._share

    @contextlib.contextmanager
    def microbatches(self) -> Iterator[None]:
        root = self.layout.root
        root._get_fsdp_state()._lazy_init()
        self.layout.settle()  # a forward outside the step (evaluation) does not change this attempt's collectives
        groups = self.layout.groups
        saved = [(group, group.reduce_grads, group.all_reduce_grads) for group in groups]
        self._share = 1.0  # until weigh: a backward attempt says its total before its first microbatch
        guard = self.guard
        guard.start(self.scripts.script(self._key))
        for group in groups:  # FSDP2's accumulation: every backward reduce-scatters into the sharded .grad
            group.reduce_grads = group.all_reduce_grads = True
        restore = guarded_comms(groups, guard, self._factor)
        try:
            try:
                yield
                guard.finish()
            except BaseException as err:
                self.layout.drop_unsharded_grads()
                root.reset_iter_state()  # reshards, and clears FSDP2's state of the aborted pass
                if isinstance(err, Exception) and guard.script is not None and not guard.broken:
                    release_memory(err)  # the failed pass's tensors go first: the stand-ins allocate
                    guard.stand_in()  # the collectives the peers still start (or where it could not)
                raise
        finally:
            restore()
            for group, reduce_grads, all_reduce in saved:
                group.reduce_grads, group.all_reduce_grads = reduce_grads, all_reduce

    def vote(self, ballot: Ballot, params: Sequence[torch.Tensor] | None = None) -> Verdict:
        status, size, total, capacity = ballot
        guard = self.guard
        recorded = guard.recorded() if status == Status.OK and not guard.aborted else None
        failure = guard.stand_in_failure
        report = self.scripts.report(self._key, guard.departed, recorded, failed=failure is not None)
        said = guard.vote_status(status)
        where = 0.0 if failure is None else float(guard.passed + 1)  # the script's position it could not start
        rows = tuple(map(tuple, guard.meet(said, (size, total, where, capacity, report))))
        reports = [row[5] for row in rows]
        if STAND_IN_FAILED in reports:
            self.discard()
            raise self._stand_in_failed(rows)
        self.scripts.agree(self._key, reports, recorded)
        verdict = verdict_of(rows, total)
        if DEPARTED in reports and verdict.status == Status.OK:  # left the script: void, nothing failed
            verdict = verdict._replace(status=Status.OOM, again=True)
        if params is not None and verdict.status == Status.OK:
            grand_total = math.fsum(r[2] for r in rows)
            if self.world_size > 1:
                self._post = self._reference / grand_total if grand_total else 0.0
                if grand_total:
                    self._reference = grand_total
            else:
                self._post = 1.0
        return verdict

    def _stand_in_failed(self, rows: Sequence[Sequence[float]]) -> RuntimeError:
        """The error every rank raises after a rank ran out of memory standing in for its script's collectives."""
        script = self.guard.script
        named = []
        for rank, row in enumerate(rows):
            if row[5] == STAND_IN_FAILED:
                position = int(row[3]) - 1
                known = script is not None and 0 <= position < len(script)
                what = script.collectives[position].describe() if known and script else f"collective {position}"
                named.append(f"rank {rank} at the {what} (position {position} of the attempt's script)")
        return RuntimeError(
            f"ElasticStep: out of memory standing in for FSDP2 collectives after a failed attempt: {'; '.join(named)}. "
            "Its peers waited in that collective until the process group's timeout: FSDP2's process groups are "
            "not usable after a timed-out collective, so every rank stops. Restart from a checkpoint, with more "
            "free memory on that rank (another process took memory during the step?)"
        )

    def agree(self, status: Status, *values: float) -> Verdict:
        check_values(values)
        return agreement_of(self.guard.agree(status, values), len(values))

    def discard(self) -> None:
        self.layout.drop_unsharded_grads()
        self._post = None

    def reduce(self, params: Sequence[torch.Tensor], scale: float) -> None:
        post, self._post = self._post, None
        if post is None or post == 1.0:
            return
        local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
        if local:
            with torch.no_grad():
                torch._foreach_mul_(local, post)

    def local_grad_sq_norm(self, grads: Sequence[torch.Tensor]) -> float:
        # HSDP: every replica holds the same shards; one replica's part counts in the sum over ranks.
        return super().local_grad_sq_norm(grads) if self.layout.replica_rank == 0 else 0.0

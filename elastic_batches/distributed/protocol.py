"""The protocol every gradient-sync scheme follows: what each rank votes, what every rank learns back.

Every method of :class:`GradientSync` is called on every rank in the same order, so every
collective has its peers. A vote is one row of numbers per rank (an attempt's: its status, the
size of its largest microbatch, its weight total, whether it left a trained parameter without a
gradient, the largest microbatch its memory model predicts fits; another phase's: its status and
up to four numbers to sum); every rank decodes the same rows into the same :class:`Verdict`.
``GradientSync`` itself is the scheme of one process: nothing to agree on, nothing to synchronise.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from elastic_batches.oom import Status

if TYPE_CHECKING:
    from elastic_batches.plan import Plan

__all__ = [
    "AGREE_VALUES",
    "Ballot",
    "GradientSync",
    "Rows",
    "Verdict",
    "VOTE_WIDTH",
    "agreement_of",
    "check_values",
    "verdict_of",
]

VOTE_WIDTH = 6  # values each rank contributes to one vote: status, size, total, unused flag, capacity, ready
AGREE_VALUES = 4  # numbers another phase's vote sums
Rows = tuple[tuple[float, ...], ...]  # every rank's vote values, in rank order


class Ballot(NamedTuple):
    """What one rank votes after an attempt (:meth:`GradientSync.vote`).

    Attributes:
        status: This rank's outcome.
        size: Size of this rank's largest microbatch (rows, or the controller's unit).
        total: This rank's weight total (rows, or counted items).
        capacity: The largest microbatch this rank's memory model predicts fits the next attempt
            (rows, or tokens); 0: no prediction. Every rank plans from the smallest.

    Example:
        >>> from elastic_batches.distributed import Ballot, Status
        >>> Ballot(Status.OK, size=4, total=8.0).capacity
        0
    """

    status: Status
    size: int
    total: float
    capacity: int = 0


class Verdict(NamedTuple):
    """What every rank learned from one vote: an attempt's (:meth:`GradientSync.vote`) or another phase's.

    Attributes:
        status: The worst outcome over ranks.
        oom_ranks: Ranks that ran out of memory.
        error_ranks: Ranks that raised an error other than an OOM.
        oom_size: An attempt's: the smallest microbatch size (rows, or tokens) that ran out of
            memory; 0 without OOM.
        size: An attempt's: the smallest over ranks of each rank's largest microbatch.
        scale: An attempt's: this rank's share of the global mean, ``total_r / sum(totals)``.
        capacity: An attempt's: the largest microbatch (rows, or tokens) that every rank's
            memory model predicts fits, the smallest over ranks; 0 when some rank predicts nothing.
        sums: Another phase's (:meth:`GradientSync.agree`): the sums over ranks of the values passed.
        again: An attempt's: void though nothing failed (FSDP2 per module: its collectives left
            their script); the same plan is tried again and nothing is learned.
    """

    status: Status
    oom_ranks: tuple[int, ...] = ()
    error_ranks: tuple[int, ...] = ()
    oom_size: int = 0
    size: int = 0
    scale: float = 1.0
    sums: tuple[float, ...] = ()
    capacity: int = 0
    again: bool = False


_ALL_OK = Verdict(Status.OK)


def _ranks(statuses: Sequence[int], status: Status) -> tuple[int, ...]:
    return tuple(rank for rank, s in enumerate(statuses) if s == status)


@functools.lru_cache(maxsize=16)  # a steady run casts the same votes step after step
def verdict_of(rows: Rows, total: float) -> Verdict:
    """An attempt's verdict from every rank's ``(status, size, total, unused, capacity, ...)``, for ``total``'s rank."""
    statuses = [int(r[0]) for r in rows]
    oom_sizes = [int(r[1]) for r in rows if int(r[0]) == Status.OOM]
    grand_total = math.fsum(r[2] for r in rows)
    capacities = [int(r[4]) if len(r) > 4 else 0 for r in rows]
    return Verdict(
        status=Status(max(statuses)),
        oom_ranks=_ranks(statuses, Status.OOM),
        error_ranks=_ranks(statuses, Status.ERROR),
        oom_size=min(oom_sizes) if oom_sizes else 0,
        size=min(int(r[1]) for r in rows),
        scale=total / grand_total if grand_total else 0.0,
        capacity=min(capacities) if all(c > 0 for c in capacities) else 0,
    )


def agreement_of(rows: Sequence[Sequence[float]], count: int) -> Verdict:
    """The verdict of another phase from every rank's ``(status, value_1, ..., value_count)``."""
    statuses = [int(r[0]) for r in rows]
    return Verdict(
        status=Status(max(statuses)),
        oom_ranks=_ranks(statuses, Status.OOM),
        error_ranks=_ranks(statuses, Status.ERROR),
        sums=tuple(math.fsum(r[1 + i] for r in rows) for i in range(count)),
    )


def check_values(values: Sequence[float]) -> None:
    """Refuse more values than a vote carries."""
    if len(values) > AGREE_VALUES:
        raise ValueError(f"GradientSync.agree takes at most {AGREE_VALUES} values, got {len(values)}")


class GradientSync:
    """One process: nothing to agree on, nothing to synchronise.

    The subclasses add agreement across ranks (a plain module), DDP and FSDP2. Every method is
    called on every rank in the same order, so every collective has its peers.

    Attributes:
        replicated: Whether every rank holds whole gradients after :meth:`reduce` (a gradient
            norm is then computed without communication).

    Example:
        >>> import torch
        >>> from elastic_batches.distributed import Ballot, GradientSync, Status
        >>> sync = GradientSync(torch.nn.Linear(2, 1))
        >>> sync.vote(Ballot(Status.OK, size=4, total=8.0)).scale
        1.0
    """

    replicated = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # The parameters, when the wrapper fixed them at its construction (DDP hooks those it found
        # then, and synchronises no other): listed once instead of walking the modules every step.
        self._fixed_parameters: tuple[nn.Parameter, ...] | None = None

    def parameters(self) -> Iterable[nn.Parameter]:
        """The model's parameters, as ``model.parameters()`` lists them."""
        return self._fixed_parameters if self._fixed_parameters is not None else self.model.parameters()

    def graph_leaf_ids(self) -> set[int]:
        """The ``id`` of every tensor a microbatch's autograd graph may accumulate a parameter gradient into."""
        return {id(p) for p in self.parameters()}

    def check_gather(self) -> Verdict:
        """Before an attempt: every rank learns whether every rank can hold what the attempt gathers first.

        Splitting cannot shrink it (FSDP2: the unsharded parameters), so a rank that cannot must
        not start gathering while its peers wait. Nothing to gather here: ``OK``, no communication.
        """
        return _ALL_OK

    def microbatches(self) -> contextlib.AbstractContextManager[None]:
        """The context every microbatch of an attempt runs in: no collective may start inside."""
        return contextlib.nullcontext()

    @property
    def pairs_microbatches(self) -> bool:
        """Whether collectives pair the ranks' microbatches (FSDP2 per module): every rank cuts as planned, as many."""
        return False

    def agree_plan(self, plan: Plan, where: str = "backward") -> Plan:
        """How an attempt cuts this rank's batch, from this rank's :class:`~elastic_batches.plan.Plan`.

        Every rank calls it before each attempt; the only place a plan is amended. ``where``: the
        attempt's kind, ``"backward"`` or ``"evaluate"``. The plan itself, except where
        collectives pair the ranks' microbatches (FSDP2 gathered per module): the largest count
        and the smallest measuring lead over ranks (while measuring, the rest of the batch is
        then cut a microbatch at a time, see :meth:`agree_pieces`).
        """
        return plan

    def agree_pieces(self, count: int, room: int) -> int:
        """Inside a measuring attempt, before each microbatch after the first: how many the rest is cut into.

        ``count``: this rank's plan for its rows left; ``room``: the most microbatches those rows
        can make. The plan itself, except where collectives pair the ranks' microbatches: the
        largest plan over ranks, at most the smallest room, so that every rank cuts as many.

        Raises:
            PeerFailure: a peer's attempt failed (paired microbatches only).
        """
        return count

    def weigh(self, total: float) -> None:
        """Before the first microbatch of a backward attempt: this rank's weight total (rows, or counted items).

        A scheme that reduces gradients inside the microbatches (FSDP2 per module) scales this
        rank's contribution by it; the others learn it from the vote.
        """

    def last_microbatch(self) -> None:
        """Before an attempt's last microbatch, once :meth:`weigh` told its total: its backward may start reducing.

        DDP starts each gradient bucket's all-reduce as soon as that backward makes it ready
        (``overlap``); the other schemes reduce after the vote.
        """

    def fall_back(self) -> bool:
        """After an OOM at the smallest microbatch on some rank, where the step would stop (every rank alike).

        Returns:
            Whether the scheme switched to one that holds less memory (FSDP2 ``gather="auto"``:
            per module from now on), so that the batch is worth trying again.
        """
        return False

    def prepare(self, params: Sequence[torch.Tensor]) -> None:
        """Allocate what :meth:`reduce` needs, before the vote: an OOM here is the attempt's OOM.

        Args:
            params: The trained parameters whose ``.grad`` the attempt accumulated.
        """

    def vote(self, ballot: Ballot, params: Sequence[torch.Tensor] | None = None) -> Verdict:
        """Share this rank's outcome of an attempt; every rank gets the same verdict back.

        Args:
            ballot: This rank's outcome, its largest microbatch, its weight total and what its
                memory model predicts fits.
            params: The parameters of a ``backward`` attempt (the same list as for
                :meth:`prepare`): DDP may start reducing their gradients in the vote's own
                collective. ``None`` (``evaluate``): no gradients.
        """
        return verdict_of(((ballot.status, ballot.size, ballot.total, 0.0, ballot.capacity),), ballot.total)

    def agree(self, status: Status, *values: float) -> Verdict:
        """One small collective: every rank learns every rank's status and the sums of ``values``.

        Args:
            status: This rank's outcome of the phase.
            values: Up to four numbers to sum over ranks (a partial squared gradient norm).
        """
        check_values(values)
        return agreement_of([(status, *values)], len(values))

    def discard(self) -> None:
        """Forget an attempt that failed on some rank: its partial gradients and prepared buffers."""

    def reduce(self, params: Sequence[torch.Tensor], scale: float) -> None:
        """Turn the ``.grad`` of ``params`` (this rank's mean over its batch) into the global mean, in place.

        A parameter without ``.grad`` (unused by ``loss_fn``) keeps none.
        """
        grads = [p.grad for p in params if p.grad is not None]
        if scale != 1.0 and grads:
            torch._foreach_mul_(grads, scale)

    def local_grad_sq_norm(self, grads: Sequence[torch.Tensor]) -> float:
        """This rank's part of the squared 2-norm of ``grads`` (the whole of it when ``replicated``)."""
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        local = [g for g in local if g.numel()]
        if not local:
            return 0.0
        norms = torch._foreach_norm(local, 2.0)
        return float(torch.stack(norms).double().pow(2).sum())

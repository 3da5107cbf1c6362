"""The collective guard: before each FSDP2 collective, every rank says on a CPU side channel whether it can join.

FSDP2 all-gathers and reduce-scatters inside every module's forward and backward. A rank that
runs out of memory between two of them would leave its peers waiting in the next one, so each
one is *guarded*: FSDP2's own collective hooks (``set_custom_all_gather`` /
``set_custom_reduce_scatter``, wrapping whatever comm was set) first run a *guard round*, a
small ``all_gather`` on a gloo group of all the mesh's ranks, and start the collective only when
every rank is at the same guard. A rank whose attempt failed (anywhere: forward, backward, the
allocation of a collective's buffer, the copy after one) goes to its *meeting point* instead —
the vote — whose rounds run on the same side channel: a rank still at a guard sees a peer at
the meeting point, raises :class:`PeerFailure` (no collective started) and comes to the
meeting point too. Rounds repeat there until every rank has arrived.

Each round carries one row of :data:`WIDTH` float64 per rank: its kind (guard, meeting point,
other agreement), its status, and five values (a guard's: which collective, how many elements,
its FSDP2 unit and its dtype, so that ranks about to start different collectives raise instead
of mixing them, though their sizes agree: two experts of a mixture, one on each rank).

The side channel is a gloo group: on a GPU, the guard is host-side only (Python floats into CPU
tensors, a gloo round between the hosts) and never waits on or enqueues anything on the
device's streams, so NCCL's collectives and the kernels queued before them keep running.

An attempt that follows a *script* (``script.py``) runs no guard round: a rank that fails stands
in for the rest of the script (:meth:`CollectiveGuard.stand_in`) before it goes to the meeting
point, so its peers' collectives complete. A rank about to start a collective other than the
script's (every rank is, at the same one) leaves the attempt there (:class:`ScriptDeparture`)
and stands in for the rest of the script too: the attempt is void, and tried again guarded. A
rank that cannot allocate its stand-ins' buffer says so at the vote, where every rank raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from elastic_batches.distributed.script import ALL_GATHER_OP, REDUCE_SCATTER_OP, Collective, Script
from elastic_batches.distributed.wire import ALL_GATHER
from elastic_batches.oom import Status, is_oom_error

__all__ = ["PIECES_OP", "WIDTH", "CollectiveGuard", "PeerFailure", "ScriptDeparture", "guarded_comms", "side_channel"]

WIDTH = 7  # kind, status, then five values
_GUARD, _MEET, _AGREE = 1.0, 2.0, 3.0  # kinds of rows
_KINDS = {_GUARD: "a collective's guard", _MEET: "the vote", _AGREE: "another agreement"}
PIECES_OP = 3.0  # the round that agrees on the next microbatch's size (beside the collectives' kinds)
_OPS = {ALL_GATHER_OP: "all-gather", REDUCE_SCATTER_OP: "reduce-scatter", PIECES_OP: "the next microbatch's size"}
# A collective's dtype as a guard round carries it (the same number on every rank).
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int32)


def _dtype_code(dtype: torch.dtype) -> float:
    return float(_DTYPES.index(dtype) + 1) if dtype in _DTYPES else float(len(_DTYPES) + 1)


class PeerFailure(torch.OutOfMemoryError):
    """Raised at an FSDP2 collective on a rank whose peer's attempt failed first: no rank starts the collective.

    ``ElasticStep`` catches it like an OOM: the rank stops its attempt, meets its peers at the
    vote (as a rank that did not run out of memory itself), and every rank retries the batch.

    Example:
        >>> import torch
        >>> from elastic_batches.distributed import PeerFailure
        >>> isinstance(PeerFailure("rank 1 ran out of memory"), torch.OutOfMemoryError)
        True
    """


class ScriptDeparture(PeerFailure):
    """Raised at an FSDP2 collective other than the script's (or at the end of an attempt that left some unstarted).

    Every rank meets it at the same point, since FSDP2 starts the same collectives on every rank.
    Each stands in for the rest of the script, so that a rank that failed before that point and
    stands in for it too is matched; the attempt is void, and ``ElasticStep`` tries it again,
    guarded, learning nothing from it.
    """


_SIDE_GROUPS: dict[tuple[int, ...], tuple[Any, dist.ProcessGroup]] = {}  # ranks -> (default group, side group)


def side_channel(ranks: Sequence[int]) -> dist.ProcessGroup:
    """The gloo group of ``ranks`` that carries guard rounds and votes; made once per set of ranks and kept.

    Every rank of ``ranks`` must call it at the same point (``dist.new_group``). A group made
    under a default process group that was destroyed since is made again.
    """
    key = tuple(ranks)
    default = dist.distributed_c10d._get_default_group()
    known = _SIDE_GROUPS.get(key)
    if known is not None and known[0] is default:
        return known[1]
    whole = key == tuple(range(dist.get_world_size()))
    group = dist.new_group(
        list(key), backend="gloo", timeout=2 * _timeout_of(default), use_local_synchronization=not whole
    )
    _SIDE_GROUPS[key] = (default, group)
    return group


def _timeout_of(group: Any) -> timedelta:
    """The group's collective timeout (its CPU or CUDA backend's), else torch's default.

    The side channel waits twice that: a rank that could not stand in for its script waits at
    the vote while its peers' collective runs into its own timeout, then they come.
    """
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return dist.distributed_c10d.default_pg_timeout


class CollectiveGuard:
    """The side channel's rounds for one rank: guards before collectives, the meeting point, other agreements.

    Args:
        group: The gloo group of every rank that runs the guarded collectives (all the mesh's).

    Attributes:
        rounds: Rounds run so far (each one small ``all_gather``).
        aborted: This rank's attempt stopped at a guard because a peer's failed (reset by :meth:`start`).
        passed: Collectives passed since :meth:`start` (with a round before them or not).
        script: The script this attempt follows, or ``None`` (a round before every collective).
        departed: This attempt left its script (:class:`ScriptDeparture`).
        stood_in: Collectives started so far in a failed rank's stead (:meth:`stand_in`).
        stand_in_failure: The first script collective this rank could not stand in for (out of
            memory allocating the stand-ins' buffer), or ``None``.
        broken: A collective of this attempt raised (a peer's timeout): this rank stands in for none.
        units: The FSDP2 units' names by index (set by :func:`guarded_comms`), for messages.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.rounds = 0
        self.aborted = False
        self.passed = 0
        self.script: Script | None = None
        self.departed = False
        self.stood_in = 0
        self.stand_in_failure: Collective | None = None
        self.broken = False
        self.units: list[str] = []
        self._ran: list[Collective] = []
        # Allocated once: a round never allocates (an OOM in it would strand the peers).
        self._mine = torch.zeros(WIDTH, dtype=torch.float64)
        self._rows = torch.zeros(self.world_size * WIDTH, dtype=torch.float64)

    def start(self, script: Script | None = None) -> None:
        """A new attempt begins: no guard passed, none aborted.

        Args:
            script: The collectives the attempt will start, every rank's alike: no round before
                them. ``None``: a round before every collective.
        """
        self.aborted, self.passed, self.departed, self.broken = False, 0, False, False
        self.script, self._ran, self.stand_in_failure = script, [], None

    def recorded(self) -> Script:
        """The collectives this attempt passed so far, as a script."""
        return Script(tuple(self._ran))

    def _round(self, kind: float, status: float, values: Sequence[float]) -> list[list[float]]:
        mine = self._mine.numpy()
        mine[0], mine[1] = kind, status
        mine[2 : 2 + len(values)] = values
        mine[2 + len(values) :] = 0.0
        getattr(dist, ALL_GATHER)(self._rows, self._mine, group=self.group)
        self.rounds += 1
        return self._rows.view(self.world_size, WIDTH).tolist()

    def before(self, op: float, numel: int, collective: Collective | None = None) -> None:
        """Before collective ``op`` of ``numel`` elements: return when every rank is at it, else raise.

        The round carries the kind, the size and, from ``collective``, the FSDP2 unit and the dtype:
        ranks about to start collectives of different units raise, though their sizes agree.
        With a script, at once: ``collective`` is recorded, and compared with the script's.

        Raises:
            PeerFailure: a peer's attempt failed (it is at the meeting point): this rank's stops too.
            ScriptDeparture: ``collective`` is not the script's (every rank is at the same point).
            RuntimeError: the ranks are about to start different collectives, or a peer finished
                the attempt while this rank still has one to start: the same on every rank.
        """
        if self.world_size == 1:
            return
        if self.aborted:  # a peer failed already: this attempt joins no more collectives
            raise PeerFailure("CUDA out of memory on a peer: this rank's attempt stopped before an FSDP2 collective")
        script, position = self.script, self.passed
        if script is not None:
            if position < len(script) and script.collectives[position] == collective:
                self._pass(collective)
                return
            self._depart(f"{_OPS.get(op, op)} of {numel} elements at position {position}")
        unit, dtype = (-1.0, 0.0) if collective is None else (float(collective.unit), _dtype_code(collective.dtype))
        rows = self._round(_GUARD, Status.OK, (op, float(numel), unit, dtype))
        meeting = [r for r, row in enumerate(rows) if row[0] != _GUARD]
        if not meeting:
            if any(row[2:6] != rows[0][2:6] for row in rows):
                described = "; ".join(f"rank {r}: {self._describe(row)}" for r, row in enumerate(rows))
                raise RuntimeError(
                    f"ElasticStep: the ranks were about to start different FSDP2 collectives ({described}): every "
                    "rank must run the same FSDP2 units, with the same trained parameters, in the same order in "
                    "every microbatch (a mixture of experts that skips an expert with no row on some ranks only "
                    "pairs different experts' collectives: run every expert on every rank, or use gather='attempt'). "
                    "A parameter that only some ranks use needs module.set_reduce_scatter_unused_params(True); no "
                    "collective was started"
                )
            self._pass(collective)
            return
        self._stop(rows, meeting, f"{_OPS.get(op, op)} of {numel} elements")

    def _describe(self, row: Sequence[float]) -> str:
        """A guard row's collective: kind, elements, dtype, unit (index and name)."""
        text = f"{_OPS.get(row[2], row[2])} of {int(row[3])}"
        code, unit = int(row[5]), int(row[4])
        if code:
            text += f" {_DTYPES[code - 1] if code <= len(_DTYPES) else 'other dtype'}"
        text += " elements"
        if unit >= 0:
            name = self.units[unit] if unit < len(self.units) else ""
            text += f" of unit {unit} ({name or 'the root'!r})"
        return text

    def _pass(self, collective: Collective | None) -> None:
        self.passed += 1
        if collective is not None:
            self._ran.append(collective)

    def finish(self) -> None:
        """The attempt's microbatches are done: a script's collectives must all have started.

        Raises:
            ScriptDeparture: some did not (every rank finishes at the same point).
        """
        script = self.script
        if script is not None and self.world_size > 1 and self.passed < len(script):
            self._depart(f"the end of the attempt at position {self.passed}")

    def _depart(self, where: str) -> NoReturn:
        self.departed = self.aborted = True  # voted as a stop for a peer's sake: not an OOM of this rank's
        raise ScriptDeparture(
            f"ElasticStep: the FSDP2 collectives of this attempt left its script ({len(self.script or ())} "
            f"collectives) at {where}; every rank leaves it there and the attempt is tried again, guarded"
        )

    def stand_in(self) -> None:
        """After this rank's attempt failed or left its script: start the script's collectives that it did not.

        Its peers start them all (or stand in too, from where they failed or left). Nothing without
        a script (its peers round before every collective), nor after a collective of this attempt
        raised (:attr:`broken`: its peers are not waiting in the rest). One buffer per dtype, of the
        largest size the rest needs, serves every stand-in; when even that runs out of memory,
        :attr:`stand_in_failure` says where, and the vote tells every rank.
        """
        script = self.script
        if script is None or self.world_size == 1 or self.broken:
            return
        rest = script.collectives[self.passed :]
        if not rest:
            return
        try:
            buffers = script.buffers(self.passed)
        except Exception as err:
            if not is_oom_error(err):
                raise
            self.stand_in_failure = rest[0]  # its peers wait in it until the process group's timeout
            return
        for collective in rest:
            collective.stand_in(buffers[collective.dtype, torch.device(collective.device)])
            self.stood_in += 1

    def vote_status(self, status: Status) -> Status:
        """What this rank votes for an attempt that ended with ``status``; clears :attr:`aborted`.

        An attempt stopped at a guard by a peer's failure (``PeerFailure``, an OOM), or that left
        its script, is not an OOM of this rank's: it votes OK, and the peer's OOM (or the vote's
        word that the attempt left its script) decides.
        """
        aborted, self.aborted = self.aborted, False
        return Status.OK if aborted and status == Status.OOM else status

    def agree_within(self, op: float, values: Sequence[float]) -> list[list[float]]:
        """Inside an attempt, at a point every rank reaches (``op``): every rank's ``values`` (at most three).

        A round like a collective's guard: a peer at the meeting point stops this rank's attempt.

        Raises:
            PeerFailure: a peer's attempt failed (it is at the meeting point): this rank's stops too.
            RuntimeError: a peer is at another point of the attempt (the same on every rank).
        """
        if self.aborted:
            raise PeerFailure("CUDA out of memory on a peer: this rank's attempt stopped before agreeing with it")
        rows = self._round(_GUARD, Status.OK, (op, *values))
        meeting = [r for r, row in enumerate(rows) if row[0] != _GUARD]
        if not meeting:
            if any(row[2] != op for row in rows):
                places = ", ".join(f"rank {r}: {_OPS.get(row[2], row[2])}" for r, row in enumerate(rows))
                raise RuntimeError(
                    f"ElasticStep: the ranks are at different points of a measuring attempt ({places}); every rank "
                    "must cut as many microbatches (per-module gathering); no collective was started"
                )
            return [row[3 : 3 + len(values)] for row in rows]
        self._stop(rows, meeting, _OPS[op])

    def _stop(self, rows: list[list[float]], meeting: list[int], where: str) -> NoReturn:
        """Peers are at the meeting point while this rank is at ``where``: raise (a peer failed, or finished)."""
        self.aborted = True
        failed = [r for r in meeting if rows[r][1] != Status.OK]
        if failed:
            raise PeerFailure(
                f"CUDA out of memory (or another error) on rank(s) {failed} during this attempt: rank {self.rank} "
                "stopped before an FSDP2 collective its peers will not join, and retries with them"
            )
        raise RuntimeError(
            f"ElasticStep: rank(s) {meeting} finished the attempt's FSDP2 collectives while rank {self.rank} was "
            f"about to start another ({where}): every rank must run as many "
            "microbatches through the same FSDP2 modules (per-module gathering: give every rank a batch of at least "
            "split_count rows, and no microbatch that count_fn counts 0 in); no collective was started"
        )

    def meet(self, status: Status, values: Sequence[float]) -> list[list[float]]:
        """The meeting point (the vote): rounds until every rank is here; every rank's ``(status, *values)``.

        A rank still at a guard sees this rank here, stops and comes too.
        """
        while True:
            rows = self._round(_MEET, status, values)
            if all(row[0] == _MEET for row in rows):
                return [row[1:] for row in rows]

    def answer(self, status: Status) -> None:
        """One round at the meeting point: a failed rank answers the guard its peers wait at (a known sequence)."""
        self._round(_MEET, status, ())

    def agree(self, status: Status, values: Sequence[float]) -> list[list[float]]:
        """An agreement outside the attempts (every rank here in step): every rank's ``(status, *values)``.

        Raises:
            RuntimeError: a rank is elsewhere on the side channel (a bug: the protocol lost its step).
        """
        rows = self._round(_AGREE, status, values)
        strays = [r for r, row in enumerate(rows) if row[0] != _AGREE]
        if strays:
            places = ", ".join(f"rank {r} at {_KINDS.get(rows[r][0], rows[r][0])}" for r in strays)
            raise RuntimeError(f"ElasticStep: the ranks' side channel is out of step ({places}); please report this")
        return [row[1:] for row in rows]


class _Recorder:
    """One FSDP2 parameter group's collectives as :class:`Collective` records, made once per shape."""

    def __init__(self, op: float, inner: Any, unit: int, fsdp_group: Any, replicate: dist.ProcessGroup | None) -> None:
        self.op, self.inner, self.unit, self.replicate = op, inner, unit, replicate
        self.fsdp_group = fsdp_group
        self._last: Collective | None = None

    def __call__(self, numel: int, tensor: torch.Tensor, group: dist.ProcessGroup, reduce_op: Any = None) -> Collective:
        last = self._last
        if last is not None and last.numel == numel and last.dtype == tensor.dtype and last.group is group:
            return last
        replicate = self.replicate
        self._last = last = Collective(
            op=self.op,
            numel=numel,
            dtype=tensor.dtype,
            device_type=tensor.device.type,
            unit=self.unit,
            world=dist.get_world_size(group),
            replicas=0 if replicate is None else dist.get_world_size(replicate),
            comm=self.inner,
            group=group,
            replicate=replicate,
            device=tensor.device,
            reduce_op=reduce_op,
            all_reduce_op=None if replicate is None else _all_reduce_op(self.fsdp_group, group, replicate, tensor),
            name=_unit_name(self.fsdp_group),
        )
        return last


def _unit_name(fsdp_group: Any) -> str:
    """The FSDP2 parameter group's module name(s) in the root (``""``: the root)."""
    return str(getattr(fsdp_group, "_module_fqn", None) or "")


def _all_reduce_op(fsdp_group: Any, group: dist.ProcessGroup, replicate: Any, tensor: torch.Tensor) -> Any:
    """The op of the all-reduce FSDP2 runs after this reduce-scatter under HSDP, as FSDP2 itself chooses it."""
    return _divide_factors(
        group,
        replicate,
        tensor.dtype,
        tensor.device.type,
        getattr(fsdp_group, "gradient_divide_factor", None),
        bool(getattr(fsdp_group, "force_sum_reduction_for_comms", False)),
    )[3]


def _inner_comm(comm: Any) -> Any:
    return comm.inner if isinstance(comm, (_GuardedAllGather, _GuardedReduceScatter)) else comm


def _fsdp_internals() -> tuple[type, type, Callable[..., Any]]:
    # FSDP2's comm interfaces and its choice of reduce ops live in private modules of torch: imported here only.
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    return AllGather, ReduceScatter, _get_gradient_divide_factors


_AllGatherBase, _ReduceScatterBase, _divide_factors = _fsdp_internals()


class _GuardedAllGather(_AllGatherBase):  # type: ignore[misc, valid-type]
    """FSDP2's all-gather comm, guarded: ``allocate`` as the inner comm's, the guard round before ``__call__``."""

    def __init__(self, inner: Any, guard: CollectiveGuard, unit: int = 0, fsdp_group: Any = None) -> None:
        self.inner, self.guard = inner, guard
        self._record = _Recorder(ALL_GATHER_OP, inner, unit, fsdp_group, None)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> Any:
        numel = output_tensor.numel()
        self.guard.before(ALL_GATHER_OP, numel, self._record(numel, output_tensor, group))
        try:
            return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)
        except Exception:
            self.guard.broken = True  # a peer never came (a timeout): nothing of the rest to stand in for
            raise


class _GuardedReduceScatter(_ReduceScatterBase):  # type: ignore[misc, valid-type]
    """FSDP2's reduce-scatter comm, guarded, its input first multiplied by this rank's ``factor()`` (in place)."""

    def __init__(
        self,
        inner: Any,
        guard: CollectiveGuard,
        factor: Callable[[], float],
        unit: int = 0,
        replicate: dist.ProcessGroup | None = None,
        fsdp_group: Any = None,
    ) -> None:
        self.inner, self.guard, self.factor = inner, guard, factor
        self._record = _Recorder(REDUCE_SCATTER_OP, inner, unit, fsdp_group, replicate)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        factor = self.factor()
        if factor != 1.0:
            input_tensor.mul_(factor)
        numel = input_tensor.numel()
        self.guard.before(REDUCE_SCATTER_OP, numel, self._record(numel, input_tensor, group, op))
        try:
            return self.inner(
                output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op, async_op=async_op
            )
        except Exception:
            self.guard.broken = True
            raise


def guarded_comms(
    groups: Sequence[Any], guard: CollectiveGuard, factor: Callable[[Any], Callable[[], float]] | None = None
) -> Callable[[], None]:
    """Guard the all-gathers (and, with ``factor``, the reduce-scatters) of FSDP2 parameter ``groups``.

    The comms the groups had (FSDP2's defaults, or the user's) run inside the guarded ones.

    Args:
        groups: FSDP2's ``FSDPParamGroup`` objects.
        guard: The guard whose rounds precede each collective.
        factor: ``group -> (() -> float)``: what multiplies that group's reduce-scatter input on
            this rank (the rank's share of the global mean); ``None`` leaves the reduce-scatters
            alone.

    Returns:
        A function that puts the groups' own comms back.
    """
    saved = [(group, group._all_gather_comm, group._reduce_scatter_comm) for group in groups]
    guard.units = [_unit_name(group) for group in groups]
    for unit, (group, all_gather, reduce_scatter) in enumerate(saved):
        group._all_gather_comm = _GuardedAllGather(_inner_comm(all_gather), guard, unit, group)
        if factor is not None:
            replicate = getattr(group.mesh_info, "replicate_process_group", None)  # HSDP: all-reduced after
            group._reduce_scatter_comm = _GuardedReduceScatter(
                _inner_comm(reduce_scatter),
                guard,
                factor(group),
                unit,
                replicate if group.all_reduce_grads else None,
                group,
            )

    def restore() -> None:
        for group, all_gather, reduce_scatter in saved:
            group._all_gather_comm, group._reduce_scatter_comm = all_gather, reduce_scatter

    return restore

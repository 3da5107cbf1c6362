"""Agreement across ranks and gradient synchronisation that an OOM on one rank cannot hang.

The protocol (``docs/distributed.md`` walks through it on two ranks):

1. Every microbatch runs without any collective: DDP under ``no_sync`` with its forward
   buffer broadcast off; FSDP2 with every parameter all-gathered once *before* the first
   microbatch and gradient reduction and resharding switched off until the last one is done.
   A rank may therefore raise at any point of any microbatch without leaving a peer waiting.
2. Still before any collective, each rank allocates what the gradient reduction will need
   (``prepare``); an OOM there is an OOM of the attempt like any other.
3. Every rank then enters one collective that carries the *vote*: its outcome (ok, OOM,
   error), the size of its largest microbatch, its weight total and whether it left a trained
   parameter without gradient. Every rank learns the same thing from it. Under DDP, once
   every rank holds the persistent buffer of the first gradient bucket (confirmed by the first
   step's vote), the vote travels in that bucket's ``all_reduce``: each rank's gradients
   pre-scaled by its total, its vote in its own slot (a rank that failed sends zeros and its
   vote). Under FSDP2 it travels in the first ``reduce_scatter``, whose buffers the first
   gather check allocated and every later step keeps (each rank's vote in every rank's part).
   Otherwise (DDP's first step, a plain module, ``evaluate``) the vote is a small
   ``all_gather`` of its own.
4. If any rank failed, every rank throws the attempt's gradients away (``discard``) and
   either retries with the same new split count or raises. Otherwise the gradients become the
   weighted mean ``sum_r(total_r * grad_r) / sum_r(total_r)`` (DDP: the remaining buckets'
   ``all_reduce``; FSDP2: bucketed ``reduce_scatter`` into the sharded gradients), using only
   memory allocated before the vote. Parameters that no rank used get their ``.grad`` back to
   ``None`` (one more small all-reduce, only after a vote in which some rank left one unused).

:func:`gradient_sync_for` picks the scheme for a model. :meth:`GradientSync.agree` is the
same small collective for other phases that may raise on one rank only (the optimizer step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from elastic_batches.oom import is_oom_error

__all__ = ["ERROR", "OK", "OOM", "GradientSync", "Outcome", "Verdict", "gradient_sync_for"]

OK, OOM, ERROR = 0, 1, 2
_BUCKET_BYTES = 25 * 1024 * 1024
_FUSED_BYTES = 1024 * 1024  # FSDP2: gradients that ride with the vote, per rank's part
# FSDP2: the dtype of the vote's reduce-scatter (float64 when some gradient is float64), and the
# gradient dtypes that ride in it: those it holds exactly.
_FUSED_RIDERS = {
    torch.float32: (torch.float32, torch.bfloat16, torch.float16),
    torch.float64: (torch.float64, torch.float32, torch.bfloat16, torch.float16),
}
_VOTE_WIDTH = 5  # values each rank contributes to one vote
_VOTE_VALUES = 4  # status, size, total, and whether a trained parameter got no gradient here: the vote of an attempt
# A fused vote carries each rank's four float64 as their 32 bytes, one byte (0..255) per
# gradient element: exact in any of these dtypes, and exact in a sum where the other ranks add 0.
_VOTE_BYTES = 8 * _VOTE_VALUES
_VOTE_STRUCT = struct.Struct(f"{_VOTE_VALUES}d")
_BYTE_CARRIERS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The vote's all-gather and the gradients' reduce-scatter: torch 2.13 renamed all_gather_into_tensor
# and reduce_scatter_tensor (the old names warn); looked up at each call, so that a test can count them.
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


class Verdict(NamedTuple):
    """What all ranks learned from one attempt.

    Attributes:
        status: The worst outcome over ranks: ``OK``, ``OOM`` or ``ERROR``.
        oom_size: The smallest microbatch size (rows) that ran out of memory; 0 without OOM.
        size: The smallest over ranks of each rank's largest microbatch (rows).
        scale: This rank's share of the global mean: ``total_r / sum(totals)`` (1 alone).
        error_ranks: Ranks whose attempt raised an error other than an OOM.
    """

    status: int
    oom_size: int
    size: int
    scale: float
    error_ranks: tuple[int, ...]


class Outcome(NamedTuple):
    """What all ranks learned from :meth:`GradientSync.agree`.

    Attributes:
        status: The worst outcome over ranks: ``OK``, ``OOM`` or ``ERROR``.
        oom_ranks: Ranks that ran out of memory.
        error_ranks: Ranks that raised an error other than an OOM.
        sums: The sums over ranks of the values passed.
    """

    status: int
    oom_ranks: tuple[int, ...]
    error_ranks: tuple[int, ...]
    sums: tuple[float, ...]


_ALL_OK = Outcome(OK, (), (), ())


_Rows = tuple[tuple[float, ...], ...]  # every rank's vote values, in rank order


@functools.lru_cache(maxsize=16)  # a steady run casts the same votes step after step
def _verdict(rows: _Rows, total: float) -> Verdict:
    """The verdict from every rank's ``(status, size, total)``, for the rank whose total is ``total``."""
    statuses = [int(r[0]) for r in rows]
    oom_sizes = [int(r[1]) for r in rows if int(r[0]) == OOM]
    grand_total = math.fsum(r[2] for r in rows)
    return Verdict(
        status=max(statuses),
        oom_size=min(oom_sizes) if oom_sizes else 0,
        size=min(int(r[1]) for r in rows),
        scale=total / grand_total if grand_total else 0.0,
        error_ranks=tuple(rank for rank, s in enumerate(statuses) if s == ERROR),
    )


def _outcome(rows: Sequence[Sequence[float]], count: int) -> Outcome:
    statuses = [int(r[0]) for r in rows]
    return Outcome(
        status=max(statuses),
        oom_ranks=tuple(rank for rank, s in enumerate(statuses) if s == OOM),
        error_ranks=tuple(rank for rank, s in enumerate(statuses) if s == ERROR),
        sums=tuple(math.fsum(r[1 + i] for r in rows) for i in range(count)),
    )


class GradientSync:
    """One process: nothing to agree on, nothing to synchronise.

    The subclasses add agreement across ranks (a plain module), DDP and FSDP2. Every method is
    called on every rank in the same order, so every collective has its peers.

    Attributes:
        replicated: Whether every rank holds whole gradients after :meth:`reduce` (a gradient
            norm is then computed without communication).

    Example:
        >>> import torch
        >>> from elastic_batches.distributed import OK, GradientSync
        >>> sync = GradientSync(torch.nn.Linear(2, 1))
        >>> sync.vote(OK, size=4, total=8.0).scale
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

    def check_gather(self) -> Outcome:
        """Before an attempt: every rank learns whether every rank can hold what the attempt gathers first.

        Splitting cannot shrink it (FSDP2: the unsharded parameters), so a rank that cannot must
        not start gathering while its peers wait. Nothing to gather here: ``OK``, no communication.
        """
        return _ALL_OK

    def microbatches(self) -> contextlib.AbstractContextManager[None]:
        """The context every microbatch of an attempt runs in: no collective may start inside."""
        return contextlib.nullcontext()

    def prepare(self, params: Sequence[torch.Tensor]) -> None:
        """Allocate what :meth:`reduce` needs, before the vote: an OOM here is the attempt's OOM.

        Args:
            params: The trained parameters whose ``.grad`` the attempt accumulated.
        """

    def vote(self, status: int, size: int, total: float, params: Sequence[torch.Tensor] | None = None) -> Verdict:
        """Share this rank's outcome of an attempt; every rank gets the same verdict back.

        Args:
            status: ``OK``, ``OOM`` or ``ERROR``.
            size: Size of this rank's largest microbatch (rows, or the controller's unit).
            total: This rank's weight total (rows, or counted items).
            params: The parameters of a ``backward`` attempt (the same list as for
                :meth:`prepare`): DDP may start reducing their gradients in the vote's own
                collective. ``None`` (``evaluate``): no gradients.
        """
        return Verdict(status, size if status == OOM else 0, size, 1.0, (0,) if status == ERROR else ())

    def agree(self, status: int, *values: float) -> Outcome:
        """One small collective: every rank learns every rank's status and the sums of ``values``.

        Args:
            status: ``OK``, ``OOM`` or ``ERROR``.
            values: Up to four numbers to sum over ranks (a partial squared gradient norm).
        """
        _check_values(values)
        return _outcome([(status, *values)], len(values))

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


def _check_values(values: Sequence[float]) -> None:
    if len(values) > _VOTE_WIDTH - 1:
        raise ValueError(f"GradientSync.agree takes at most {_VOTE_WIDTH - 1} values, got {len(values)}")


class _VoteBytes:
    """A vote that rides in a sum: this rank's values as bytes in its slot, every rank's values read from the sum.

    Each rank owns ``_VOTE_BYTES`` elements, one byte (0..255) of its four float64 per element;
    the others add zeros there, so the sum holds every rank's bytes exactly. A steady run casts
    the same vote step after step: the slots are written again only when this rank's bytes
    change, and the sum is decoded again only when it differs from the last one decoded. The
    comparison runs on the host: a vote may follow an attempt that filled the device, so
    nothing here allocates there.

    Args:
        rank: This rank.
        world: The number of ranks.
        dtype: The dtype of the collective that carries the vote (one of :data:`_BYTE_CARRIERS`).
    """

    def __init__(self, rank: int, world: int, dtype: torch.dtype) -> None:
        self.rank, self.world = rank, world
        self.host = torch.zeros(world * _VOTE_BYTES, dtype=dtype)  # this rank's slot, zeros in the others'
        self._written = b""
        self._received = torch.zeros(world * _VOTE_BYTES, dtype=dtype)  # the sum, copied to the host
        self._decoded = torch.zeros(world * _VOTE_BYTES, dtype=dtype)  # the last sum decoded
        self._every_vote = struct.Struct(f"{world * _VOTE_VALUES}d")
        self._rows: _Rows | None = None

    def slots(self, values: Sequence[float]) -> torch.Tensor:
        """The host tensor to send, holding ``values`` (status, size, total, unused flag) in this rank's slot."""
        packed = _VOTE_STRUCT.pack(*values)
        if packed != self._written:
            slots = bytearray(self.world * _VOTE_BYTES)  # writable, as torch.frombuffer wants
            slots[self.rank * _VOTE_BYTES : (self.rank + 1) * _VOTE_BYTES] = packed
            self.host.copy_(torch.frombuffer(slots, dtype=torch.uint8))
            self._written = packed
        return self.host

    def read(self, summed: torch.Tensor) -> _Rows:
        """Every rank's vote values from the summed slots."""
        if summed.device.type != "cpu":
            self._received.copy_(summed)
            summed = self._received
        if self._rows is None or not torch.equal(summed, self._decoded):
            values = self._every_vote.unpack(bytes(map(round, summed.tolist())))
            self._rows = tuple(values[r * _VOTE_VALUES : (r + 1) * _VOTE_VALUES] for r in range(self.world))
            self._decoded.copy_(summed)
        return self._rows


class _HostWritten:
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


class _SingleRankDDP(GradientSync):
    """DDP over one rank: every microbatch under ``no_sync``, and nothing to reduce.

    DDP's reducer would otherwise copy every microbatch's gradients into its buckets and
    all-reduce them with no peer: 1.5x the step of a small model.
    """

    def __init__(self, model: nn.parallel.DistributedDataParallel) -> None:
        super().__init__(model)
        self.ddp = model
        self._fixed_parameters = tuple(model.parameters())

    def microbatches(self) -> contextlib.AbstractContextManager[None]:
        return self.ddp.no_sync()


class _Agreeing(GradientSync):
    """Several ranks: agree on the outcome; gradients are the user's business (a plain module)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(model)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if dist.get_backend(group) == dist.Backend.GLOO:
            self.device = torch.device("cpu")
        else:
            self.device = next(model.parameters()).device
        # Allocated once, so that a vote never allocates (an OOM in it would strand the peers).
        self._mine = _HostWritten(_VOTE_WIDTH, torch.float64, self.device)
        self._gathered = torch.zeros(self.world_size * _VOTE_WIDTH, dtype=torch.float64, device=self.device)

    def _exchange(self, values: Sequence[float]) -> _Rows:
        getattr(dist, _ALL_GATHER)(self._gathered, self._mine.write(values), group=self.group)
        return tuple(map(tuple, self._gathered.view(self.world_size, _VOTE_WIDTH).tolist()))

    def vote(self, status: int, size: int, total: float, params: Sequence[torch.Tensor] | None = None) -> Verdict:
        return _verdict(self._exchange((status, size, total)), total)

    def agree(self, status: int, *values: float) -> Outcome:
        _check_values(values)
        return _outcome(self._exchange((status, *values)), len(values))

    def reduce(self, params: Sequence[torch.Tensor], scale: float) -> None:
        pass


# -- bucketed collectives over preallocated memory ---------------------------------------------


def _buckets(sizes: Sequence[int], element_size: int) -> list[list[int]]:
    """Indices of consecutive tensors of ``sizes`` elements, grouped in about ``_BUCKET_BYTES``."""
    buckets: list[list[int]] = []
    bucket: list[int] = []
    nbytes = 0
    for index, numel in enumerate(sizes):
        if bucket and nbytes >= _BUCKET_BYTES:
            buckets.append(bucket)
            bucket, nbytes = [], 0
        bucket.append(index)
        nbytes += numel * element_size
    if bucket:
        buckets.append(bucket)
    return buckets


def _by_kind(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device], list[int]]:
    kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for index, tensor in enumerate(tensors):
        kinds.setdefault((tensor.dtype, tensor.device), []).append(index)
    return kinds


def _memory_order(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s elements as a 1-D view in the order they lie in memory; ``None`` unless one dense block.

    Autograd gives a gradient the layout of its parameter when that is dense (channels-last
    included) and a contiguous one otherwise, so a gradient always has such a view.
    """
    if tensor.is_contiguous():
        return tensor.view(-1)
    permuted = tensor.permute(sorted(range(tensor.dim()), key=tensor.stride, reverse=True))
    return permuted.view(-1) if permuted.is_contiguous() else None


def _segments(numels: Sequence[int], splittable: Sequence[bool], capacity: int) -> list[list[tuple[int, int, int]]]:
    """Buckets of ``(index, start, stop)`` (elements of tensor ``index``) of at most ``capacity`` elements.

    Consecutive tensors fill a bucket; a splittable tensor continues in the next bucket where
    one is full, so that no bucket exceeds ``capacity``. A tensor that cannot be split goes
    whole into a bucket (alone when it is larger than ``capacity``). Empty tensors are left out.
    """
    buckets: list[list[tuple[int, int, int]]] = []
    bucket: list[tuple[int, int, int]] = []
    room = capacity
    for index, numel in enumerate(numels):
        start = 0
        while start < numel:
            whole = not splittable[index]
            if bucket and (room <= 0 or (whole and numel > room)):
                buckets.append(bucket)
                bucket, room = [], capacity
            stop = numel if whole else min(numel, start + room)
            bucket.append((index, start, stop))
            room -= stop - start
            start = stop
    if bucket:
        buckets.append(bucket)
    return buckets


@dataclasses.dataclass
class _Bucket:
    """Segments of tensors reduced together in one collective, through views of a persistent flat buffer."""

    segments: list[tuple[int, int, int]]  # (tensor index, start, stop) over the tensor's elements in memory order
    views: list[torch.Tensor]  # per segment, where it lies in the flat buffer (shaped as the tensor if whole)
    flat: torch.Tensor  # the used part of the flat buffer: the concatenated segments


class _FlatPlan:
    """Tensors in buckets of at most ``_BUCKET_BYTES``, one flat buffer per dtype and device, reused per bucket.

    The buffers are allocated once, here, and kept with the plan: nothing is allocated when a
    bucket runs. With ``vote_numel``, the first bucket belongs to a dtype that can carry a vote
    (:data:`_BYTE_CARRIERS`) and ``vote_numel`` more elements follow it in its buffer: ``fused``
    is the first bucket and that vote segment, reduced in one collective.

    Args:
        tensors: What the buckets will hold (the parameters, for their gradients; their
            shapes, dtypes, devices and layouts).
        vote_numel: Elements of the vote segment; 0: none.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], vote_numel: int = 0) -> None:
        self.splittable = [_memory_order(t) is not None for t in tensors]
        self.cut: set[int] = set()  # tensors split between buckets: copied through their memory-order views
        kinds = list(_by_kind(tensors).items())
        carriers = [k for k, ((dtype, _), _) in enumerate(kinds) if dtype in _BYTE_CARRIERS]
        if vote_numel and carriers:
            kinds.insert(0, kinds.pop(carriers[0]))
        self.buckets: list[_Bucket] = []
        self.fused: torch.Tensor | None = None
        self.vote: torch.Tensor | None = None
        for kind, ((dtype, device), indices) in enumerate(kinds):
            capacity = max(1, _BUCKET_BYTES // dtype.itemsize)
            numels = [tensors[i].numel() for i in indices]
            grouped = _segments(numels, [self.splittable[i] for i in indices], capacity)
            if not grouped:
                continue
            sizes = [sum(stop - start for _, start, stop in bucket) for bucket in grouped]
            extra = vote_numel if kind == 0 and carriers else 0
            buffer = torch.empty(max(max(sizes), sizes[0] + extra), dtype=dtype, device=device)
            if extra:
                self.fused = buffer[: sizes[0] + extra]
                self.vote = buffer[sizes[0] : sizes[0] + extra]
            for bucket, size in zip(grouped, sizes, strict=True):
                segments = [(indices[j], start, stop) for j, start, stop in bucket]
                views, offset = [], 0
                for i, start, stop in segments:
                    view = buffer[offset : offset + stop - start]
                    if start == 0 and stop == tensors[i].numel():
                        view = view.view(tensors[i].shape)  # a whole tensor: copied as it is, whatever its layout
                    else:
                        self.cut.add(i)
                    views.append(view)
                    offset += stop - start
                self.buckets.append(_Bucket(segments, views, buffer[:size]))

    def bind(self, tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Per bucket, the parts of ``tensors`` (shaped as the plan's) that its segments copy.

        A tensor that lies whole in one bucket is its own part; one split between buckets is cut
        from its elements in memory order.

        Raises:
            RuntimeError: a tensor that the plan splits is not one dense block (a gradient
                assigned by hand with another layout than its parameter's).
        """
        ordered: dict[int, torch.Tensor] = {}
        for i in self.cut:
            view = _memory_order(tensors[i])
            if view is None:
                tensor = tensors[i]
                raise RuntimeError(
                    f"ElasticStep: a gradient of shape {tuple(tensor.shape)} and strides {tensor.stride()} is not "
                    "one dense block, as its parameter is: give it its parameter's layout (torch.empty_like)"
                )
            ordered[i] = view
        return [
            [ordered[i][start:stop] if i in ordered else tensors[i] for i, start, stop in bucket.segments]
            for bucket in self.buckets
        ]

    def fill(self, index: int, parts: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        """Copy ``parts`` (bucket ``index``'s, from :meth:`bind`) into the flat buffer, times ``scale``."""
        bucket = self.buckets[index]
        torch._foreach_copy_(bucket.views, parts)
        if scale != 1.0:
            bucket.flat.mul_(scale)
        return bucket.flat

    def drain(self, index: int, parts: list[torch.Tensor], scale: float = 1.0) -> None:
        """Copy bucket ``index``'s flat buffer, times ``scale``, back into ``parts``."""
        bucket = self.buckets[index]
        if scale != 1.0:
            bucket.flat.mul_(scale)
        torch._foreach_copy_(parts, bucket.views)


class _UsedMap:
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
        self._counts: _HostWritten | None = None

    def record(self, used: list[bool]) -> None:
        """Before the vote: which parameters got a gradient here; allocates the counts when their number changes."""
        if self._counts is None or self._counts.numel != len(used):
            self._counts = None  # free the old ones first
            self._counts = _HostWritten(len(used), torch.float32, self.device)
        self.used = used

    @property
    def flag(self) -> float:
        """This rank's vote value (at index 3 of its row): 1 if it left a parameter unused."""
        return float(self.used is not None and not all(self.used))

    def learn(self, status: int, rows: Sequence[Sequence[float]]) -> None:
        """From every rank's vote: whether an attempt that fitted left some parameter unused on some rank."""
        self.somewhere = status == OK and any(r[3] for r in rows)

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


class _DistributedDataParallel(_Agreeing):
    """DDP: microbatches under ``no_sync``; the vote in the first bucket's all-reduce, then the others.

    The flat buffers of the gradient buckets are allocated at the first ``prepare`` and kept
    (one bucket of at most 25 MiB per gradient dtype, plus the vote segment: 32 elements per
    rank). Until every rank has confirmed in a separate vote that it holds them, votes are
    separate ``all_gather``; from then on (the second step), a rank whose attempt failed can
    still join the first bucket's all-reduce, with zeros, without allocating anything. With
    ``broadcast_buffers`` (DDP's default), a flat copy of the module's buffers is kept too, for
    their broadcast after the vote.
    """

    def __init__(self, model: nn.parallel.DistributedDataParallel) -> None:
        if model.static_graph:
            raise NotImplementedError(
                "ElasticStep does not support DistributedDataParallel(static_graph=True): its first backward starts "
                "DDP's own reduction, which ElasticStep replaces with its own (vote first, then reduce). Create DDP "
                "without static_graph: its optimizations are for DDP's reduction, which ElasticStep does not use"
            )
        sparse = [
            name
            for name, m in model.module.named_modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        ]
        if sparse:
            raise NotImplementedError(
                f"ElasticStep under DDP reduces dense gradients only; module(s) {sparse} make sparse ones "
                "(sparse=True): create them with sparse=False"
            )
        hooks = [getattr(hook, "__qualname__", repr(hook)) for hook, _ in getattr(model, "_comm_hooks", ())]
        if hooks:
            raise NotImplementedError(
                f"ElasticStep reduces the gradients itself and would skip the DDP communication hook(s) {hooks} "
                "registered with register_comm_hook, changing what they do to the gradients: create DDP without them"
            )
        super().__init__(model, model.process_group)
        self.ddp = model
        self._fixed_parameters = tuple(model.parameters())
        # Parameters DDP leaves out of its gradient sync (``_set_params_and_buffers_to_ignore_for_model``).
        ignored = model.parameters_to_ignore
        self._ignored = {id(p) for name, p in model.module.named_parameters() if name in ignored}
        self._plan: _FlatPlan | None = None  # persistent, for the parameters of ``_plan_key``
        self._plan_key: tuple[int, ...] = ()
        # The parameters for which every rank confirmed a plan that fuses: then, and only then, the
        # vote is fused. Changed only by a vote, so it is the same on every rank.
        self._fused_key: tuple[int, ...] | None = None
        self._reference = 1.0  # the last grand total: gradients are pre-scaled by total_r / reference
        self._votes: _VoteBytes | None = None  # the vote segment as this rank sends it, and the votes read back
        self._parts: list[list[torch.Tensor]] | None = None  # this attempt's gradients, bound to the plan
        self._bucket0_factor: float | None = None  # after a fused vote that fitted: bucket 0's factor still to apply
        self._buffer_plan: _FlatPlan | None = None  # persistent, for the buffers of ``_buffer_key``
        self._buffer_key: tuple[int, ...] = ()
        self._buffer_parts: list[list[torch.Tensor]] = []  # this attempt's buffers, bound to the plan
        self._used = _UsedMap(self.device, self.group)

    @contextlib.contextmanager
    def microbatches(self) -> Iterator[None]:
        # DDP broadcasts buffers at the start of a forward when the previous forward synced;
        # that collective could meet a rank that is elsewhere after an OOM: buffers are
        # broadcast after the vote instead (``reduce``).
        self.ddp.require_forward_param_sync = False
        with self.ddp.no_sync():
            yield

    def _synced(self, params: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The parameters whose gradients DDP synchronises: all but those it was told to ignore."""
        return [p for p in params if id(p) not in self._ignored] if self._ignored else params

    # Without no_grad: nothing here is recorded by autograd (zeros, views of gradients), and the
    # context took about a quarter of a steady step's prepare.
    def prepare(self, params: Sequence[torch.Tensor]) -> None:
        params = self._synced(params)
        self._used.record([p.grad is not None for p in params])
        # Every rank must reduce the same tensors: a parameter unused here may be used elsewhere.
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        key = tuple(map(id, params))
        if key != self._plan_key:
            self._plan, self._plan_key, self._votes = None, (), None  # free the old buffers first
            plan = _FlatPlan(params, vote_numel=self.world_size * _VOTE_BYTES)
            if plan.vote is not None:
                self._votes = _VoteBytes(self.rank, self.world_size, plan.vote.dtype)
            self._plan, self._plan_key = plan, key
        assert self._plan is not None
        self._parts = self._plan.bind([p.grad for p in params if p.grad is not None])
        buffers = self._synced_buffers()
        key = tuple(map(id, buffers))
        if key != self._buffer_key:
            self._buffer_plan, self._buffer_key = None, ()  # free the old copy first
            self._buffer_plan, self._buffer_key = (_FlatPlan(buffers) if buffers else None), key
        self._buffer_parts = self._buffer_plan.bind(buffers) if self._buffer_plan is not None else []

    def _synced_buffers(self) -> list[torch.Tensor]:
        """The buffers DDP broadcasts from rank 0 at a forward, listed anew each time as DDP does (reassignable).

        As DDP, none when its list from the last listing (at construction) is empty.
        """
        if not self.ddp.broadcast_buffers or not self.ddp.modules_buffers:
            return []
        ignored = self.ddp.parameters_to_ignore
        return [b for name, b in self.ddp.module.named_buffers() if b.numel() and name not in ignored]

    def vote(self, status: int, size: int, total: float, params: Sequence[torch.Tensor] | None = None) -> Verdict:
        if params is None:
            return super().vote(status, size, total)
        key = tuple(map(id, self._synced(params)))
        fused = key == self._fused_key
        if fused:
            rows = self._fused_vote(status, size, total)
        else:
            ready = key == self._plan_key and self._plan is not None and self._plan.fused is not None
            rows = self._exchange((status, size, total, self._used.flag, float(ready)))
            self._fused_key = key if all(r[4] for r in rows) else None
        verdict = _verdict(rows, total)
        self._used.learn(verdict.status, rows)
        grand_total = math.fsum(r[2] for r in rows)
        if fused and verdict.status == OK:  # bucket 0 holds sum_r(total_r * grad_r) / reference
            self._bucket0_factor = self._reference / grand_total if grand_total else 0.0
        if grand_total:
            self._reference = grand_total
        return verdict

    def _fused_vote(self, status: int, size: int, total: float) -> _Rows:
        """All-reduce bucket 0, pre-scaled by ``total / reference``, and every rank's vote bytes in one collective.

        A rank whose attempt failed sends zeros in place of its gradients. Nothing here
        allocates on the device.
        """
        plan, votes = self._plan, self._votes
        assert plan is not None and plan.fused is not None and plan.vote is not None and votes is not None
        if status == OK:
            assert self._parts is not None
            plan.fill(0, self._parts[0], total / self._reference)
        else:
            plan.buckets[0].flat.zero_()
        plan.vote.copy_(votes.slots((status, size, total, self._used.flag)))
        dist.all_reduce(plan.fused, group=self.group)
        return votes.read(plan.vote)

    def discard(self) -> None:
        self._parts, self._bucket0_factor, self._buffer_parts = None, None, []
        self._used.reset()

    def reduce(self, params: Sequence[torch.Tensor], scale: float) -> None:
        if self._parts is None:
            self.prepare(params)
        plan, parts = self._plan, self._parts
        assert plan is not None and parts is not None
        first = 0
        if self._bucket0_factor is not None:  # the fused vote reduced bucket 0 (pre-scaled by total_r / reference)
            plan.drain(0, parts[0], self._bucket0_factor)
            first = 1
        for index in range(first, len(plan.buckets)):
            dist.all_reduce(plan.fill(index, parts[index], scale), group=self.group)
            plan.drain(index, parts[index])
        synced = self._synced(params)
        for index in self._used.unused_everywhere():
            synced[index].grad = None
        buffer_plan, buffer_parts = self._buffer_plan, self._buffer_parts
        self.discard()
        if buffer_plan is not None and buffer_parts:
            source = dist.get_global_rank(self.ddp.process_group, 0)
            for index in range(len(buffer_plan.buckets)):
                dist.broadcast(buffer_plan.fill(index, buffer_parts[index]), src=source, group=self.group)
                buffer_plan.drain(index, buffer_parts[index])


# -- FSDP2 ---------------------------------------------------------------------------------------


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule


@dataclasses.dataclass
class _ShardedGrad:
    """One FSDP2 parameter's gradient on its way from unsharded (every rank) to sharded (this rank's rows)."""

    fsdp_param: Any  # torch's FSDPParam
    sharded: Any  # the sharded parameter (a DTensor)
    full: torch.Tensor | None = None  # the accumulated unsharded gradient
    local: torch.Tensor | None = None  # this rank's rows of the reduced gradient
    offset: int = 0  # of its segment in a rank's part of the bucket
    chunk_rows: int = 0  # rows of each rank's (padded) chunk
    row_numel: int = 1  # elements per row


def _fill(send: torch.Tensor, e: _ShardedGrad) -> None:
    """Copy ``e``'s unsharded gradient into its columns of ``send`` (a row per rank), each rank's rows in its row."""
    assert e.full is not None
    world = send.shape[0]
    rows, width = e.sharded.shape[0], e.chunk_rows * e.row_numel
    full = e.full.reshape(rows, e.row_numel)
    if rows == world * e.chunk_rows:
        send[:, e.offset : e.offset + width].copy_(full.view(world, width))
        return
    for r in range(world):
        lo, hi = r * e.chunk_rows, min((r + 1) * e.chunk_rows, rows)
        part = send[r, e.offset : e.offset + width]
        filled = max(0, hi - lo) * e.row_numel
        if filled:
            part[:filled].view(hi - lo, e.row_numel).copy_(full[lo:hi])
        part[filled:].zero_()


class _FusedVote:
    """The buffers of FSDP2's first reduce-scatter, kept for the run: each rank's part holds the votes, then gradients.

    Every rank writes its vote into its slot in every rank's part (zeros elsewhere), so the
    reduce-scatter hands each rank all the votes. A rank whose attempt failed sends what the
    buffer holds in place of gradients (the others discard the result): nothing is allocated.
    """

    def __init__(self, rank: int, world: int, numel: int, dtype: torch.dtype, device: str) -> None:
        self.world, self.numel = world, numel
        self.riders = _FUSED_RIDERS[dtype]  # the gradient dtypes it carries
        slots = world * _VOTE_BYTES
        self.send = torch.zeros(world, slots + numel, dtype=dtype, device=device)
        self.receive = torch.zeros(slots + numel, dtype=dtype, device=device)
        # This rank's slots: written on the host, copied whole to the device (no temporary there), then
        # into every rank's part on the device.
        self._votes = _VoteBytes(rank, world, dtype)
        host = self._votes.host
        self._slots = host if self.send.device.type == "cpu" else torch.zeros_like(host, device=device)

    def parts(self) -> torch.Tensor:
        """The gradient columns of every rank's part (a view: fill it before :meth:`exchange`)."""
        return self.send[:, self.world * _VOTE_BYTES :]

    def exchange(self, values: Sequence[float], group: dist.ProcessGroup | None) -> _Rows:
        """Send this rank's vote ``values`` with the gradients; every rank's vote values."""
        host = self._votes.slots(values)
        if self._slots is not host:
            self._slots.copy_(host)
        self.send[:, : self.world * _VOTE_BYTES].copy_(self._slots.expand(self.world, -1))
        getattr(dist, _REDUCE_SCATTER)(self.receive, self.send.view(-1), group=group)
        return self._votes.read(self.receive[: self.world * _VOTE_BYTES])

    def received(self) -> torch.Tensor:
        """This rank's part of the reduced gradients, after :meth:`exchange`."""
        return self.receive[self.world * _VOTE_BYTES :]


class _FullyShard(_Agreeing):
    """FSDP2 (``fully_shard``): all-gather once, no collective in the microbatches, the vote in a reduce-scatter.

    Memory: while the microbatches run, every FSDP2 module's parameters are unsharded at once
    and the gradients accumulate unsharded (what DDP holds); after the last microbatch the
    parameters are resharded, and the reduction takes one bucket of ``world_size x 25 MiB``
    plus this rank's sharded gradients. The first reduce-scatter, which carries the vote,
    goes through buffers kept for the whole run (``world_size x`` at most 1 MiB, float32 or
    float64 when some gradient is: narrower gradients in it are summed in its dtype), so that
    a rank whose attempt failed joins it without allocating.
    """

    replicated = False

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.tensor import DTensor, Shard

        fsdp_module = _fsdp_module_type()
        assert fsdp_module is not None
        self.modules: list[Any] = [m for m in model.modules() if isinstance(m, fsdp_module)]
        if not hasattr(model, "reset_iter_state"):
            raise NotImplementedError(
                f"ElasticStep needs FSDPModule.reset_iter_state to recover FSDP2 after an OOM; torch "
                f"{torch.__version__} lacks it: upgrade torch (tested with 2.13)"
            )
        self._params: list[Any] = []
        for module in self.modules:
            for group in _param_groups(module):
                self._params.extend(group.fsdp_params)
        managed = {id(fp.sharded_param) for fp in self._params}
        for name, p in model.named_parameters():
            if p.requires_grad and id(p) not in managed:
                raise NotImplementedError(
                    f"ElasticStep: parameter {name!r} of the FSDP2 model is not sharded by fully_shard "
                    "(ignored_params?); shard every trained parameter"
                )
        # fully_shard without mesh= makes a new, equal DeviceMesh per call: meshes are compared by equality.
        meshes: list[Any] = []
        for fp in self._params:
            if not any(fp.sharded_param.device_mesh == seen for seen in meshes):
                meshes.append(fp.sharded_param.device_mesh)
        if len(meshes) != 1:
            raise NotImplementedError(
                f"ElasticStep supports FSDP2 over one device mesh, got {len(meshes)} different meshes: "
                "shard every module of the model over the same mesh"
            )
        (mesh,) = meshes
        for fp in self._params:
            p = fp.sharded_param
            if mesh.ndim != 1 or tuple(p.placements) != (Shard(0),) or not isinstance(p, DTensor) or p.dim() == 0:
                raise NotImplementedError(
                    f"ElasticStep supports FSDP2 with a 1-D mesh and Shard(0) parameters (fully_shard's default); "
                    f"got placements {tuple(p.placements)} on a {mesh.ndim}-D mesh (HSDP, shard_placement_fn and "
                    "tensor parallelism are not supported yet)"
                )
        super().__init__(model, mesh.get_group())
        self.root: Any = model
        self.mesh = mesh
        self._grads: list[_ShardedGrad] | None = None
        self._buffers: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._buckets: list[tuple[torch.dtype, list[_ShardedGrad], int]] = []
        self._used = _UsedMap(self.device, self.group)
        # The vote's reduce-scatter: each rank's part is the vote slots, then gradients.
        self._fused: _FusedVote | None = None  # allocated by the first gather check, kept
        self._fused_grads: list[_ShardedGrad] = []  # this attempt's gradients that ride with the vote
        self._fused_factor: float | None = None  # after a vote that fitted: theirs still to apply
        self._reference = 1.0  # the last grand total: those gradients are pre-scaled by total_r / reference

    def _flags(self) -> list[tuple[Any, Any, bool, Any, bool, tuple[bool, bool]]]:
        """FSDP2's per-group settings that ``microbatches`` changes, to restore them after."""
        saved = []
        for module in self.modules:
            state = module._get_fsdp_state()
            for group in _param_groups(module):
                saved.append(
                    (
                        state,
                        group,
                        state._auto_reshard_after_forward,
                        group.post_forward_mesh_info,
                        group.reshard_after_backward,
                        (group.reduce_grads, group.all_reduce_grads),
                    )
                )
        return saved

    def check_gather(self) -> Outcome:
        """Reserve, for a moment, what unsharding every module takes; then agree on who could.

        The unsharded parameters (in their all-gather dtype) plus one group's all-gather buffer.
        Freed at once: the caching allocator then serves the all-gathers from that memory.
        """
        status = OK
        try:
            self.root._get_fsdp_state()._lazy_init()  # settles the all-gather dtypes (mixed precision)
            if self._fused is None:
                self._fused = self._fused_vote()
            torch.empty(self._gather_bytes(), dtype=torch.uint8, device=self._params[0].sharded_param.to_local().device)
        except Exception as err:  # noqa: BLE001 - any failure is told to the peers, which must not wait for it
            status = OOM if is_oom_error(err) else ERROR
        return self.agree(status)

    def _fused_vote(self) -> _FusedVote:
        """The vote's reduce-scatter buffers: float64 if some gradient is, else float32; 1 MiB a part, or less.

        Each rank's part holds what fits of the gradients it can carry exactly, as :meth:`prepare`
        will place them.
        """
        # A gradient accumulates in the reduction dtype (mixed precision), if any.
        dtypes = [fp.reduce_dtype or fp.param_dtype or fp.orig_dtype for fp in self._params]
        dtype = torch.float64 if torch.float64 in dtypes else torch.float32
        parts = 0
        for fp, grad_dtype in zip(self._params, dtypes, strict=True):
            if grad_dtype in _FUSED_RIDERS[dtype]:
                rows = fp.sharded_param.shape[0]
                parts += -(-rows // self.world_size) * (fp.sharded_param.numel() // rows if rows else 0)
        numel = min(_FUSED_BYTES // dtype.itemsize, parts)
        return _FusedVote(self.rank, self.world_size, numel, dtype, self.mesh.device_type)

    def _gather_bytes(self) -> int:
        total, largest = 0, 0
        for module in self.modules:
            for group in _param_groups(module):
                nbytes = self.world_size * sum(
                    fp.padded_sharded_param_size.numel() * (fp.param_dtype or fp.orig_dtype).itemsize
                    for fp in group.fsdp_params
                )
                total, largest = total + nbytes, max(largest, nbytes)
        return total + largest

    @contextlib.contextmanager
    def microbatches(self) -> Iterator[None]:
        self.root._get_fsdp_state()._lazy_init()  # the root's own defaults first, so that they are restored
        saved = self._flags()
        try:
            for module in self.modules:
                module.set_reshard_after_forward(False, recurse=False)
                module.set_reshard_after_backward(False, recurse=False)
                module.set_requires_gradient_sync(False, recurse=False)
            for module in self.modules:
                module.unshard()  # the only all-gathers of the step: every rank is here together
            try:
                yield
            except BaseException:
                self._drop_unsharded_grads()
                self.root.reset_iter_state()  # reshards, and clears FSDP's state of the aborted pass
                raise
            for module in self.modules:
                module.reshard()  # the unsharded gradients stay, on FSDP's unsharded parameters
        finally:
            for state, group, auto, post_forward, after_backward, (reduce_grads, all_reduce) in saved:
                state._auto_reshard_after_forward = auto
                group.post_forward_mesh_info = post_forward
                group.reshard_after_backward = after_backward
                group.reduce_grads, group.all_reduce_grads = reduce_grads, all_reduce

    def graph_leaf_ids(self) -> set[int]:
        # FSDP2's forward runs on the unsharded parameters, whose gradients it reduces into the sharded ones.
        return super().graph_leaf_ids() | {id(fp._unsharded_param) for fp in self._params}

    def _drop_unsharded_grads(self) -> None:
        for fp in self._params:
            fp._unsharded_param.grad = None
            fp.unsharded_accumulated_grad = None

    @torch.no_grad()
    def prepare(self, params: Sequence[torch.Tensor]) -> None:
        world, rank = self.world_size, self.rank
        grads: list[_ShardedGrad] = []
        used: list[bool] = []
        for fp in self._params:
            p = fp.sharded_param
            if not p.requires_grad:
                continue
            full = fp.unsharded_accumulated_grad
            if full is None:
                full = fp._unsharded_param.grad
            used.append(full is not None)
            if full is None:  # unused here, maybe used on another rank: every rank reduces the same tensors
                full = torch.zeros(p.shape, dtype=p.dtype, device=p.to_local().device)
            rows = p.shape[0]
            chunk_rows = -(-rows // world)
            entry = _ShardedGrad(fp, p, full, chunk_rows=chunk_rows, row_numel=p.numel() // rows if rows else 0)
            entry.local = torch.empty_like(p.to_local())
            expected = max(0, min(chunk_rows, rows - rank * chunk_rows))
            if entry.local.shape[0] != expected:
                raise NotImplementedError(
                    f"ElasticStep: FSDP2 shard of {tuple(p.shape)} has {entry.local.shape[0]} rows on rank {rank}, "
                    f"expected torch.chunk's {expected}: this FSDP2 layout is not supported"
                )
            grads.append(entry)
        assert self._fused is not None  # allocated by the gather check before every attempt
        fused, room = [], self._fused.numel
        buckets: list[tuple[torch.dtype, list[_ShardedGrad], int]] = []
        largest: dict[torch.dtype, int] = {}
        by_dtype: dict[torch.dtype, list[_ShardedGrad]] = {}
        for entry in grads:
            assert entry.full is not None
            width = entry.chunk_rows * entry.row_numel
            if entry.full.dtype in self._fused.riders and width <= room:  # rides with the vote
                entry.offset = self._fused.numel - room
                room -= width
                fused.append(entry)
                continue
            by_dtype.setdefault(entry.full.dtype, []).append(entry)
        for dtype, entries in by_dtype.items():
            segments = [e.chunk_rows * e.row_numel for e in entries]
            for bucket in _buckets([s * world for s in segments], dtype.itemsize):
                offset = 0
                for i in bucket:
                    entries[i].offset = offset
                    offset += segments[i]
                buckets.append((dtype, [entries[i] for i in bucket], offset))
                largest[dtype] = max(largest.get(dtype, 0), offset)
        device = self.mesh.device_type
        self._buffers = {
            dtype: (
                torch.empty(world * n, dtype=dtype, device=device),
                torch.empty(n, dtype=dtype, device=device),
            )
            for dtype, n in largest.items()
        }
        self._used.record(used)
        self._grads, self._buckets, self._fused_grads = grads, buckets, fused

    def vote(self, status: int, size: int, total: float, params: Sequence[torch.Tensor] | None = None) -> Verdict:
        if params is None:  # no gradients to reduce (evaluation): the vote alone
            return super().vote(status, size, total)
        fused = self._fused
        assert fused is not None
        parts = fused.parts()
        if status == OK:  # pre-scaled by total_r / reference: the grand total is known only after the vote
            for entry in self._fused_grads:
                _fill(parts, entry)
            if total != self._reference:
                parts.mul_(total / self._reference)
        rows = fused.exchange((status, size, total, self._used.flag), self.group)
        verdict = _verdict(rows, total)
        self._used.learn(verdict.status, rows)
        grand_total = math.fsum(r[2] for r in rows)
        if verdict.status == OK:
            self._fused_factor = self._reference / grand_total if grand_total else 0.0
        if grand_total:
            self._reference = grand_total
        return verdict

    def discard(self) -> None:
        self._drop_unsharded_grads()
        self._grads, self._buckets, self._buffers, self._fused_grads = None, [], {}, []
        self._fused_factor = None
        self._used.reset()

    def reduce(self, params: Sequence[torch.Tensor], scale: float) -> None:
        from torch.distributed.tensor import DTensor

        assert self._grads is not None and self._fused is not None and self._fused_factor is not None
        received = self._fused.received()
        if self._fused_factor != 1.0:
            received.mul_(self._fused_factor)  # in the vote's dtype, before a narrower gradient is rounded
        for e in self._fused_grads:  # reduced with the vote
            assert e.local is not None
            e.local.view(-1).copy_(received[e.offset : e.offset + e.local.numel()])
        world = self.world_size
        for dtype, entries, segment in self._buckets:
            send_buffer, receive_buffer = self._buffers[dtype]
            send = send_buffer[: world * segment].view(world, segment)
            for e in entries:
                _fill(send, e)
            if scale != 1.0:
                send.mul_(scale)
            receive = receive_buffer[:segment]
            getattr(dist, _REDUCE_SCATTER)(receive, send.view(-1), group=self.group)
            for e in entries:
                assert e.local is not None
                e.local.view(-1).copy_(receive[e.offset : e.offset + e.local.numel()])
        unused_everywhere = self._used.unused_everywhere()
        with torch.no_grad():
            for index, e in enumerate(self._grads):
                assert e.local is not None
                if index in unused_everywhere:
                    e.sharded.grad = None
                    continue
                e.sharded.grad = DTensor.from_local(
                    e.local, e.sharded.device_mesh, e.sharded.placements, run_check=False, shape=e.sharded.shape,
                    stride=e.sharded.stride(),
                )  # fmt: skip
        self.discard()


def _param_groups(module: nn.Module) -> list[Any]:
    """The FSDPParamGroups of one FSDP2 module (torch internals, read in this one place)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def gradient_sync_for(model: nn.Module) -> GradientSync:
    """The synchronisation scheme for ``model``: alone, DDP, FSDP2, or a plain module on several ranks.

    On one rank, DDP runs every microbatch under ``no_sync`` (unless ``static_graph`` or a
    communication hook needs DDP's own reduction) and FSDP2 takes the scheme it has on several
    ranks (one all-gather and one reduce-scatter an attempt, instead of FSDP2's every microbatch).

    Raises:
        NotImplementedError: on several ranks, FSDP1 (``FullyShardedDataParallel``), an FSDP2
            layout other than a 1-D mesh with ``Shard(0)`` parameters, DDP with
            ``static_graph=True``, with a communication hook or with sparse gradients.

    Example:
        >>> import torch
        >>> from elastic_batches.distributed import gradient_sync_for
        >>> type(gradient_sync_for(torch.nn.Linear(2, 2))).__name__
        'GradientSync'
    """
    if not (dist.is_available() and dist.is_initialized()):
        return GradientSync(model)
    alone = dist.get_world_size() == 1
    if isinstance(model, nn.parallel.DistributedDataParallel):
        if dist.get_world_size(model.process_group) > 1:
            return _DistributedDataParallel(model)
        hooks = getattr(model, "_comm_hooks", ())
        if model.static_graph or hooks:
            # DDP's own reduction, every microbatch: a static graph's first backward must be
            # DDP's, and a communication hook may change the gradients (compression).
            return GradientSync(model)
        return _SingleRankDDP(model)
    fsdp_module = _fsdp_module_type()
    if fsdp_module is not None and isinstance(model, fsdp_module):
        try:
            return _FullyShard(model)
        except NotImplementedError:
            if alone:  # FSDP2 reduces each microbatch by itself: slower than one reduction, as exact
                return GradientSync(model)
            raise
    if alone:
        return GradientSync(model)
    if type(model).__name__ == "FullyShardedDataParallel":
        raise NotImplementedError(
            "ElasticStep does not support FSDP1 (FullyShardedDataParallel): shard the model with FSDP2, "
            "torch.distributed.fsdp.fully_shard"
        )
    if fsdp_module is not None and any(isinstance(m, fsdp_module) for m in model.modules()):
        raise NotImplementedError(
            f"ElasticStep: {type(model).__qualname__} holds FSDP2 modules but is not one itself: apply "
            "fully_shard to the root module too, and pass that module to ElasticStep"
        )
    return _Agreeing(model)

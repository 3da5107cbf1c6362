"""FSDP2 (``fully_shard``), gathered once an attempt: every module unsharded once, the vote in the first reduce-scatter.

No collective runs inside a microbatch: before the first one every FSDP2 module is all-gathered
(after a gather check on which every rank agrees, each all-gather guarded: ``guard.py``), and
reduction and resharding are switched off until the last one is done; the accumulated unsharded
gradients are then reduce-scattered into the sharded ``.grad`` through buffers allocated before
the vote (HSDP: reduce-scattered in the shard group, then all-reduced across replicas).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastic_batches.distributed.gradient_buckets import DEFAULT_BUCKET_BYTES, group_by_bytes
from elastic_batches.distributed.guard import CollectiveGuard, guarded_comms, side_channel
from elastic_batches.distributed.plain import Agreeing
from elastic_batches.distributed.protocol import Ballot, Rows, Verdict, agreement_of, check_values, verdict_of
from elastic_batches.distributed.wire import REDUCE_SCATTER, VOTE_BYTES, UsedMap, VoteBytes
from elastic_batches.oom import Status, status_of

__all__ = ["DEFAULT_FUSED_BYTES", "FSDPLayout", "FullyShard", "fsdp_module_type", "param_groups"]

DEFAULT_FUSED_BYTES = 1024 * 1024  # gradients that ride with the vote, per rank's part
# The dtype of the vote's reduce-scatter (float64 when some gradient is float64), and the gradient
# dtypes that ride in it: those it holds exactly.
FUSED_RIDERS = {
    torch.float32: (torch.float32, torch.bfloat16, torch.float16),
    torch.float64: (torch.float64, torch.float32, torch.bfloat16, torch.float16),
}


def fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule


class FSDPLayout:
    """What both FSDP2 schemes need of a sharded model: its FSDP2 modules, parameters, mesh and process groups.

    Args:
        model: The root FSDP2 module.

    Raises:
        NotImplementedError: a trained parameter is not sharded by ``fully_shard``, the
            parameters lie on different meshes, the mesh is neither 1-D nor 2-D (HSDP), or torch
            lacks ``reset_iter_state``.
    """

    def __init__(self, model: nn.Module) -> None:
        fsdp_module = fsdp_module_type()
        assert fsdp_module is not None
        if not hasattr(model, "reset_iter_state"):
            raise NotImplementedError(
                f"ElasticStep needs FSDPModule.reset_iter_state to recover FSDP2 after an OOM; torch "
                f"{torch.__version__} lacks it: upgrade torch (tested with 2.13)"
            )
        self.root: Any = model
        # One module per FSDP2 unit: fully_shard([a, b]) (tied weights) makes one unit of a and b, one state.
        self.modules: list[Any] = []
        states: set[int] = set()
        for m in model.modules():
            state = m._get_fsdp_state() if isinstance(m, fsdp_module) else None  # type: ignore[operator]
            if state is not None and id(state) not in states:
                states.add(id(state))
                self.modules.append(m)
        self.groups: list[Any] = [group for module in self.modules for group in param_groups(module)]
        self.params: list[Any] = [fp for group in self.groups for fp in group.fsdp_params]
        managed = {id(fp.sharded_param) for fp in self.params}
        for name, p in model.named_parameters():
            if p.requires_grad and id(p) not in managed:
                raise NotImplementedError(
                    f"ElasticStep: parameter {name!r} of the FSDP2 model is not sharded by fully_shard "
                    "(ignored_params?); shard every trained parameter"
                )
        # fully_shard without mesh= makes a new, equal DeviceMesh per call: meshes are compared by equality.
        meshes: list[Any] = []
        for fp in self.params:
            if not any(fp.sharded_param.device_mesh == seen for seen in meshes):
                meshes.append(fp.sharded_param.device_mesh)
        if len(meshes) != 1:
            raise NotImplementedError(
                f"ElasticStep supports FSDP2 over one device mesh, got {len(meshes)} different meshes: "
                "shard every module of the model over the same mesh"
            )
        (self.mesh,) = meshes
        if self.mesh.ndim not in (1, 2):
            raise NotImplementedError(
                f"ElasticStep supports FSDP2 over a 1-D mesh or a 2-D HSDP mesh (replicate, shard), got a "
                f"{self.mesh.ndim}-D mesh"
            )
        self.hsdp = self.mesh.ndim == 2
        # HSDP: FSDP2's mesh is (replicate, shard); parameters are sharded over the last dimension.
        self.shard_group = self.mesh.get_group(self.mesh.ndim - 1)
        self.replicate_group = self.mesh.get_group(0) if self.hsdp else None
        self.shard_world = dist.get_world_size(self.shard_group)
        self.shard_rank = dist.get_rank(self.shard_group)
        self.replicas = dist.get_world_size(self.replicate_group) if self.hsdp else 1
        self.replica_rank = dist.get_rank(self.replicate_group) if self.hsdp else 0
        self.ranks = [int(r) for r in self.mesh.mesh.flatten().tolist()]

    def side_channel(self) -> dist.ProcessGroup:
        """The gloo group of every rank of the mesh, for guard rounds and votes."""
        return side_channel(self.ranks)

    def settle(self) -> None:
        """Before an attempt: undo what a forward that ``ElasticStep`` did not run left of an FSDP2 iteration.

        A forward with no backward after it (``torch.no_grad()`` evaluation, ``step.evaluate``)
        leaves the root unsharded and FSDP2's post-forward order filled, which no backward
        clears: the next backward would skip the root's all-gather and prefetch a unit of that
        forward. ``reset_iter_state()`` reshards and clears them, so every attempt starts where a
        training step leaves FSDP2; after a backward, nothing is done.
        """
        state = self.root._get_fsdp_state()
        if state._comm_ctx.post_forward_order:
            self.root.reset_iter_state()

    def drop_unsharded_grads(self) -> None:
        for fp in self.params:
            if hasattr(fp, "_unsharded_param"):
                fp._unsharded_param.grad = None
            fp.unsharded_accumulated_grad = None

    def unsharded_ids(self) -> set[int]:
        """FSDP2's forward runs on the unsharded parameters: those a microbatch's graph accumulates into."""
        return {id(fp._unsharded_param) for fp in self.params if hasattr(fp, "_unsharded_param")}


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


def _copy(target: torch.Tensor, source: torch.Tensor, scale: float) -> None:
    """``target = source * scale``, computed in ``target``'s dtype; in one pass where the two dtypes are the same."""
    if scale != 1.0 and source.dtype == target.dtype:
        torch.mul(source, scale, out=target)
        return
    target.copy_(source)
    if scale != 1.0:
        target.mul_(scale)


def _fill(send: torch.Tensor, e: _ShardedGrad, scale: float = 1.0) -> None:
    """Copy ``e``'s unsharded gradient, times ``scale``, into its columns of ``send`` (a row per rank), each rank's
    rows in its row."""
    assert e.full is not None
    world = send.shape[0]
    rows, width = e.sharded.shape[0], e.chunk_rows * e.row_numel
    full = e.full.reshape(rows, e.row_numel)
    if rows == world * e.chunk_rows:
        _copy(send[:, e.offset : e.offset + width], full.view(world, width), scale)
        return
    for r in range(world):
        lo, hi = r * e.chunk_rows, min((r + 1) * e.chunk_rows, rows)
        part = send[r, e.offset : e.offset + width]
        filled = max(0, hi - lo) * e.row_numel
        if filled:
            _copy(part[:filled].view(hi - lo, e.row_numel), full[lo:hi], scale)
        part[filled:].zero_()


class _FusedVote:
    """The buffers of FSDP2's first reduce-scatter, kept for the run: each rank's part holds the votes, then gradients.

    Every rank writes its vote into its slot in every rank's part (zeros elsewhere), so the
    reduce-scatter hands each rank all the votes. A rank whose attempt failed sends what the
    buffer holds in place of gradients (the others discard the result): nothing is allocated.
    """

    def __init__(self, rank: int, world: int, numel: int, dtype: torch.dtype, device: str) -> None:
        self.world, self.numel = world, numel
        self.riders = FUSED_RIDERS[dtype]  # the gradient dtypes it carries
        slots = world * VOTE_BYTES
        self.send = torch.zeros(world, slots + numel, dtype=dtype, device=device)
        self.receive = torch.zeros(slots + numel, dtype=dtype, device=device)
        # This rank's slots: written on the host, copied whole to the device (no temporary there), then
        # into every rank's part on the device.
        self._votes = VoteBytes(rank, world, dtype)
        host = self._votes.host
        self._slots = host if self.send.device.type == "cpu" else torch.zeros_like(host, device=device)

    def parts(self) -> torch.Tensor:
        """The gradient columns of every rank's part (a view: fill it before :meth:`exchange`)."""
        return self.send[:, self.world * VOTE_BYTES :]

    def exchange(self, values: Sequence[float], group: dist.ProcessGroup | None) -> Rows:
        """Send this rank's vote ``values`` with the gradients; every rank's vote values."""
        host = self._votes.slots(values)
        if self._slots is not host:
            self._slots.copy_(host)
        self.send[:, : self.world * VOTE_BYTES].copy_(self._slots.expand(self.world, -1))
        getattr(dist, REDUCE_SCATTER)(self.receive, self.send.view(-1), group=group)
        return self._votes.read(self.receive[: self.world * VOTE_BYTES])

    def received(self) -> torch.Tensor:
        """This rank's part of the reduced gradients, after :meth:`exchange`."""
        return self.receive[self.world * VOTE_BYTES :]


class FullyShard(Agreeing):
    """FSDP2 (``fully_shard``): all-gather once, no collective in the microbatches, the vote in a reduce-scatter.

    Memory: while the microbatches run, every FSDP2 module's parameters are unsharded at once
    and the gradients accumulate unsharded (what DDP holds); after the last microbatch the
    parameters are resharded, and the reduction takes one bucket of ``shards x
    bucket_bytes`` plus this rank's sharded gradients. The first reduce-scatter, which carries
    the vote, goes through buffers kept for the whole run (``world_size x`` at most
    ``fused_bytes``, float32 or float64 when some gradient is: narrower gradients in it are
    summed in its dtype), so that a rank whose attempt failed joins it without allocating.
    Under HSDP (a 2-D mesh) the vote is a round of the side channel instead, and each bucket is
    reduce-scattered in the shard group, then all-reduced across the replicas.

    Each all-gather of the unsharding is guarded (``guard.py``): a rank that runs out of memory
    while unsharding answers the guard its peers wait at, and every rank votes the attempt lost.

    Args:
        model: The root FSDP2 module.
        bucket_bytes: The most one reduce-scatter bucket holds per rank's part.
        fused_bytes: The most of the gradients that ride with the vote, per rank's part.
        layout: The model's :class:`FSDPLayout` (made from ``model`` by default).
        guard: The side channel's guard, shared with another scheme of the same model.
        headroom: The gather check reserves ``headroom`` times what gathering holds beyond
            FSDP2's own memory (``"auto"``: 2, the unsharded parameters and gradients twice); 0:
            the unsharded parameters only, the check of ``gather="attempt"``.
    """

    replicated = False

    def __init__(
        self,
        model: nn.Module,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        fused_bytes: int = DEFAULT_FUSED_BYTES,
        layout: FSDPLayout | None = None,
        guard: CollectiveGuard | None = None,
        headroom: float = 0.0,
    ) -> None:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        layout = layout if layout is not None else FSDPLayout(model)
        expected = (Replicate(), Shard(0)) if layout.hsdp else (Shard(0),)
        for fp in layout.params:
            p = fp.sharded_param
            if tuple(p.placements) != expected or not isinstance(p, DTensor) or p.dim() == 0:
                raise NotImplementedError(
                    f"ElasticStep gathering once an attempt supports FSDP2 with Shard(0) parameters (fully_shard's "
                    f"default) over a 1-D mesh, or HSDP's (Replicate(), Shard(0)) over a 2-D one; got placements "
                    f"{tuple(p.placements)} on a {layout.mesh.ndim}-D mesh (shard_placement_fn and tensor parallelism "
                    "are not supported: per-module gathering, gather='module', supports shard_placement_fn)"
                )
        self.layout = layout
        self.guard = guard if guard is not None else CollectiveGuard(layout.side_channel())
        # The agreements: in the 1-D mesh's group (the vote rides in its first reduce-scatter); under HSDP on
        # the side channel, where the votes go too.
        super().__init__(model, self.guard.group if layout.hsdp else layout.shard_group)
        self.modules, self._params, self.mesh, self.root = layout.modules, layout.params, layout.mesh, layout.root
        self.bucket_bytes, self.fused_bytes, self.headroom = bucket_bytes, fused_bytes, headroom
        self._grads: list[_ShardedGrad] | None = None
        self._buffers: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._buckets: list[tuple[torch.dtype, list[_ShardedGrad], int]] = []
        self._used = UsedMap(self.device, self.group)
        # The vote's reduce-scatter (1-D meshes): each rank's part is the vote slots, then gradients.
        self._fused: _FusedVote | None = None  # allocated by the first gather check, kept
        self._fused_grads: list[_ShardedGrad] = []  # this attempt's gradients that ride with the vote
        self._fused_factor: float | None = None  # after a vote that fitted: theirs still to apply
        self._reference = 1.0  # the last grand total: those gradients are pre-scaled by total_r / reference
        self._all_gathers = sum(1 for _ in layout.groups) if layout.shard_world > 1 else 0  # guarded per unshard

    def _flags(self) -> list[tuple[Any, Any, bool, Any, bool, tuple[bool, bool]]]:
        """FSDP2's per-group settings that ``microbatches`` changes, to restore them after."""
        saved = []
        for module in self.modules:
            state = module._get_fsdp_state()
            for group in param_groups(module):
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

    def check_gather(self) -> Verdict:
        """Reserve, for a moment, what unsharding every module takes; then agree on who could.

        The unsharded parameters (in their all-gather dtype) plus one group's all-gather buffer;
        with ``headroom``, that many times the unsharded parameters and gradients instead.
        Freed at once: the caching allocator then serves the all-gathers from that memory.
        """
        status = Status.OK
        try:
            self.root._get_fsdp_state()._lazy_init()  # settles the all-gather dtypes (mixed precision)
            if self._fused is None and not self.layout.hsdp:
                self._fused = self._fused_vote()
            device = self._params[0].sharded_param.to_local().device
            torch.empty(self.gather_bytes(), dtype=torch.uint8, device=device)
        except Exception as err:  # noqa: BLE001 - any failure is told to the peers, which must not wait for it
            status = status_of(err)
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
            if grad_dtype in FUSED_RIDERS[dtype]:
                rows = fp.sharded_param.shape[0]
                parts += -(-rows // self.world_size) * (fp.sharded_param.numel() // rows if rows else 0)
        numel = min(self.fused_bytes // dtype.itemsize, parts)
        return _FusedVote(self.rank, self.world_size, numel, dtype, self.mesh.device_type)

    def gather_bytes(self) -> int:
        """Bytes the gather check reserves (see :meth:`check_gather`)."""
        shards = self.layout.shard_world
        params, grads, largest = 0, 0, 0
        for group in self.layout.groups:
            nbytes = shards * sum(
                fp.padded_sharded_param_size.numel() * (fp.param_dtype or fp.orig_dtype).itemsize
                for fp in group.fsdp_params
            )
            grads += shards * sum(
                fp.padded_sharded_param_size.numel() * (fp.reduce_dtype or fp.param_dtype or fp.orig_dtype).itemsize
                for fp in group.fsdp_params
                if fp.sharded_param.requires_grad
            )
            params, largest = params + nbytes, max(largest, nbytes)
        if self.headroom:
            return int(self.headroom * (params + grads)) + largest
        return params + largest

    @contextlib.contextmanager
    def microbatches(self) -> Iterator[None]:
        self.root._get_fsdp_state()._lazy_init()  # the root's own defaults first, so that they are restored
        self.layout.settle()
        saved = self._flags()
        try:
            for module in self.modules:
                module.set_reshard_after_forward(False, recurse=False)
                module.set_reshard_after_backward(False, recurse=False)
                module.set_requires_gradient_sync(False, recurse=False)
            self._unshard()  # the only all-gathers of the step: every rank is here together
            try:
                yield
            except BaseException:
                self.layout.drop_unsharded_grads()
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

    def _unshard(self) -> None:
        """All-gather every module, each all-gather guarded; a rank that fails answers the guard its peers are at.

        The all-gathers are a known sequence (one per parameter group): a rank that fails after
        passing ``k`` guards answers guard ``k + 1``, if there is one, in one round; its peers
        stop there (``PeerFailure``) and every rank goes on to the vote.
        """
        guard = self.guard
        guard.start()
        restore = guarded_comms(self.layout.groups, guard)
        try:
            for module in self.modules:
                module.unshard()
        except BaseException as err:
            if not guard.aborted and guard.passed < self._all_gathers:
                guard.answer(status_of(err) if isinstance(err, Exception) else Status.ERROR)
            self.layout.drop_unsharded_grads()
            self.root.reset_iter_state()
            raise
        finally:
            restore()
        if guard.passed != self._all_gathers and guard.world_size > 1:
            raise RuntimeError(
                f"ElasticStep: unsharding the FSDP2 model ran {guard.passed} all-gathers, {self._all_gathers} were "
                "expected (one per parameter group): please report this"
            )

    def graph_leaf_ids(self) -> set[int]:
        # FSDP2's forward runs on the unsharded parameters, whose gradients it reduces into the sharded ones.
        return super().graph_leaf_ids() | self.layout.unsharded_ids()

    @torch.no_grad()
    def prepare(self, params: Sequence[torch.Tensor]) -> None:
        world, rank = self.layout.shard_world, self.layout.shard_rank
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
        fused: list[_ShardedGrad] = []
        room = self._fused.numel if self._fused is not None else 0
        buckets: list[tuple[torch.dtype, list[_ShardedGrad], int]] = []
        largest: dict[torch.dtype, int] = {}
        by_dtype: dict[torch.dtype, list[_ShardedGrad]] = {}
        for entry in grads:
            assert entry.full is not None
            width = entry.chunk_rows * entry.row_numel
            if self._fused is not None and entry.full.dtype in self._fused.riders and width <= room:
                entry.offset = self._fused.numel - room  # rides with the vote
                room -= width
                fused.append(entry)
                continue
            by_dtype.setdefault(entry.full.dtype, []).append(entry)
        for dtype, entries in by_dtype.items():
            segments = [e.chunk_rows * e.row_numel for e in entries]
            for bucket in group_by_bytes([s * world for s in segments], dtype.itemsize, self.bucket_bytes):
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

    def vote(self, ballot: Ballot, params: Sequence[torch.Tensor] | None = None) -> Verdict:
        status, size, total, capacity = ballot
        said = self.guard.vote_status(status)
        if self.layout.hsdp:  # the side channel's meeting point: the peers' votes, whatever their guards saw
            values = (size, total, self._used.flag if params else 0.0, capacity)
            rows: Rows = tuple(map(tuple, self.guard.meet(said, values)))
            if params is None:
                return verdict_of(rows, total)
        elif params is None:  # no gradients to reduce (evaluation): the vote alone
            return super().vote(ballot._replace(status=said))
        else:
            fused = self._fused
            assert fused is not None
            parts = fused.parts()
            if status == Status.OK:  # pre-scaled by total_r / reference: the grand total is known only after the vote
                for entry in self._fused_grads:
                    _fill(parts, entry)
                if total != self._reference:
                    parts.mul_(total / self._reference)
            rows = fused.exchange((said, size, total, self._used.flag, capacity), self.group)
        verdict = verdict_of(rows, total)
        self._used.learn(verdict.status, rows)
        grand_total = math.fsum(r[2] for r in rows)
        if verdict.status == Status.OK:
            self._fused_factor = self._reference / grand_total if grand_total else 0.0
        if grand_total:
            self._reference = grand_total
        return verdict

    def agree(self, status: Status, *values: float) -> Verdict:
        if not self.layout.hsdp:
            return super().agree(status, *values)
        check_values(values)
        return agreement_of(self.guard.agree(status, values), len(values))

    def discard(self) -> None:
        self.layout.drop_unsharded_grads()
        self._grads, self._buckets, self._buffers, self._fused_grads = None, [], {}, []
        self._fused_factor = None
        self._used.reset()

    def release(self) -> None:
        """Free the buffers kept for the run (the vote's reduce-scatter): the scheme is no longer used."""
        self.discard()
        self._fused = None

    def reduce(self, params: Sequence[torch.Tensor], scale: float) -> None:
        from torch.distributed.tensor import DTensor

        assert self._grads is not None and self._fused_factor is not None
        if self._fused is not None:
            received = self._fused.received()
            if self._fused_factor != 1.0:
                received.mul_(self._fused_factor)  # in the vote's dtype, before a narrower gradient is rounded
            for e in self._fused_grads:  # reduced with the vote
                assert e.local is not None
                e.local.view(-1).copy_(received[e.offset : e.offset + e.local.numel()])
        world = self.layout.shard_world
        for dtype, entries, segment in self._buckets:
            send_buffer, receive_buffer = self._buffers[dtype]
            send = send_buffer[: world * segment].view(world, segment)
            for e in entries:
                _fill(send, e, scale)  # scaled as copied: one pass over the gradients
            receive = receive_buffer[:segment]
            getattr(dist, REDUCE_SCATTER)(receive, send.view(-1), group=self.layout.shard_group)
            if self.layout.replicate_group is not None:
                dist.all_reduce(receive, group=self.layout.replicate_group)
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

    def local_grad_sq_norm(self, grads: Sequence[torch.Tensor]) -> float:
        # HSDP: every replica holds the same shards; one replica's part counts in the sum over ranks.
        return super().local_grad_sq_norm(grads) if self.layout.replica_rank == 0 else 0.0


def param_groups(module: nn.Module) -> list[Any]:
    """The FSDPParamGroups of one FSDP2 module (torch internals, read in this one place)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)

"""Agreement across ranks and gradient synchronisation that an OOM on one rank cannot hang.

The protocol (``docs/distributed.md`` walks through it on two ranks):

1. Every microbatch runs without any collective that a rank's OOM could strand: DDP under
   ``no_sync`` with its forward buffer broadcast off (from the second step, the last
   microbatch's backward starts the gradient buckets' all-reduces in an order every rank
   shares, and a rank that fails stands in for those it did not start: ``overlap``); FSDP2 gathered once an attempt with
   every parameter all-gathered *before* the first microbatch and gradient reduction and
   resharding switched off until the last one is done; FSDP2 gathered per module with each of
   FSDP2's own collectives *guarded*: a round on a CPU side channel first, in which every rank
   says whether it can still join (``guard``). A rank may therefore raise at any point of any
   microbatch without leaving a peer waiting.
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

The package, one file a concept: ``protocol`` (what every rank votes and learns, the one-process
scheme), ``wire`` (how a vote travels), ``buckets`` (flat gradient buckets), ``overlap`` (DDP's
bucket schedule in the last microbatch), ``guard`` (the side channel that guards FSDP2's
collectives), ``plain`` (several ranks, a module without a
wrapper), ``ddp``, ``fsdp2`` (gathered once an attempt), ``fsdp2_modules`` (gathered per module)
and ``fsdp2_auto`` (the choice between them).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from elastic_batches.distributed.ddp import DistributedDataParallel, SingleRankDDP
from elastic_batches.distributed.fsdp2 import DEFAULT_FUSED_BYTES, FullyShard, fsdp_module_type
from elastic_batches.distributed.fsdp2_auto import AutoGather
from elastic_batches.distributed.fsdp2_modules import ShardPerModule
from elastic_batches.distributed.gradient_buckets import DEFAULT_BUCKET_BYTES
from elastic_batches.distributed.guard import PeerFailure
from elastic_batches.distributed.plain import Agreeing
from elastic_batches.distributed.protocol import Ballot, GradientSync, Verdict
from elastic_batches.oom import Status

__all__ = ["GATHER_MODES", "Ballot", "GradientSync", "PeerFailure", "Status", "Verdict", "gradient_sync_for"]

GATHER_MODES = ("auto", "attempt", "module")


def gradient_sync_for(
    model: nn.Module,
    *,
    gather: str = "auto",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    fused_bytes: int = DEFAULT_FUSED_BYTES,
) -> GradientSync:
    """The synchronisation scheme for ``model``: alone, DDP, FSDP2, or a plain module on several ranks.

    On one rank, DDP runs every microbatch under ``no_sync`` (unless ``static_graph`` or a
    communication hook needs DDP's own reduction) and FSDP2 takes the scheme it has on several
    ranks.

    Args:
        model: The module ``ElasticStep`` trains (plain, DDP-wrapped or the root FSDP2 module).
        gather: FSDP2 only: ``"attempt"`` all-gathers every module once an attempt and keeps it
            unsharded through the microbatches (fast; the memory of DDP); ``"module"`` gathers
            and reshards each module as FSDP2 is configured and reduce-scatters every
            microbatch's gradients (FSDP2's own memory, every collective guarded); ``"auto"``
            (default): once an attempt while every rank can hold the unsharded parameters and
            gradients twice, per module otherwise, and per module after an OOM at the smallest
            microbatch (``docs/distributed.md``).
        bucket_bytes: The most one gradient bucket holds (DDP: per bucket; FSDP2: per rank's part).
        fused_bytes: FSDP2: the most of the gradients that ride with the vote, per rank's part.

    Raises:
        ValueError: ``gather`` is not one of ``"auto"``, ``"attempt"``, ``"module"``.
        NotImplementedError: on several ranks, FSDP1 (``FullyShardedDataParallel``), an FSDP2
            layout other than a 1-D mesh or a 2-D HSDP mesh (``"attempt"``: with ``Shard(0)``
            parameters), DDP with ``static_graph=True``, with a communication hook or with
            sparse gradients.

    Example:
        >>> import torch
        >>> from elastic_batches.distributed import gradient_sync_for
        >>> type(gradient_sync_for(torch.nn.Linear(2, 2))).__name__
        'GradientSync'
    """
    if gather not in GATHER_MODES:
        raise ValueError(f"gather must be one of {list(GATHER_MODES)}, got {gather!r}")
    if not (dist.is_available() and dist.is_initialized()):
        return GradientSync(model)
    alone = dist.get_world_size() == 1
    if isinstance(model, nn.parallel.DistributedDataParallel):
        if dist.get_world_size(model.process_group) > 1:
            return DistributedDataParallel(model, bucket_bytes=bucket_bytes)
        hooks = getattr(model, "_comm_hooks", ())
        if model.static_graph or hooks:
            # DDP's own reduction, every microbatch: a static graph's first backward must be
            # DDP's, and a communication hook may change the gradients (compression).
            return GradientSync(model)
        return SingleRankDDP(model)
    fsdp_module = fsdp_module_type()
    if fsdp_module is not None and isinstance(model, fsdp_module):
        try:
            if gather == "module":
                return ShardPerModule(model)
            if gather == "auto":
                return AutoGather.of(model, bucket_bytes=bucket_bytes, fused_bytes=fused_bytes)
            return FullyShard(model, bucket_bytes=bucket_bytes, fused_bytes=fused_bytes)
        except NotImplementedError:
            if alone:  # FSDP2 reduces each microbatch by itself: slower than one reduction, as exact
                return GradientSync(model)
            raise
    if alone:
        return GradientSync(model)
    if type(model).__name__ == "FullyShardedDataParallel":
        raise NotImplementedError(
            "ElasticStep does not support FSDP1 (FullyShardedDataParallel), which reduces gradients inside every "
            "backward where an OOM on one rank would leave the others waiting: shard the model with FSDP2, "
            "torch.distributed.fsdp.fully_shard (each block, then the root), and pass the root module to "
            "ElasticStep; under Lightning, strategy=ModelParallelStrategy() with fully_shard in configure_model"
        )
    if fsdp_module is not None and any(isinstance(m, fsdp_module) for m in model.modules()):
        raise NotImplementedError(
            f"ElasticStep: {type(model).__qualname__} holds FSDP2 modules but is not one itself: apply "
            "fully_shard to the root module too, and pass that module to ElasticStep"
        )
    return Agreeing(model)

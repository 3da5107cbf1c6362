"""``ElasticStep``: runs a batch as microbatches, retries it on OOM, leaves the full-batch gradient.

The step is the front door: ``backward`` and ``evaluate`` hand their work
(:mod:`elastic_batches.work`) to the :class:`~elastic_batches.engine.AttemptEngine`, which plans,
runs, votes and retries; ``optimizer_step`` and ``clip_grad_norm_`` make a phase that splitting
cannot help fail on every rank together.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from elastic_batches.batch import ElasticBatch, Microbatch
from elastic_batches.controller import SplitController
from elastic_batches.distributed import GATHER_MODES, GradientSync, gradient_sync_for
from elastic_batches.engine import AttemptEngine, raise_if_failed
from elastic_batches.memory import MemoryProbe, check_memory
from elastic_batches.oom import Status, status_of
from elastic_batches.work import BackwardWork, CountFn, EvaluateWork, LossFn, input_leaves

__all__ = ["ElasticStep"]


class ElasticStep:
    """Runs forward and backward of a batch as microbatches, so that it fits in memory.

    ``backward`` cuts the batch into as many microbatches as its :class:`SplitController` says,
    runs ``loss_fn`` on each and backpropagates ``loss * weight``; when any microbatch runs out
    of memory (forward or backward), the partial work is thrown away, the controller raises the
    count, and the same batch is retried. The gradients left in ``.grad`` are those of the mean
    loss over the whole batch (over all ranks' batches under DDP), added to any gradient that
    was already there.

    Every parameter ``loss_fn`` uses must belong to ``model``: their gradients are the ones set
    aside and restored around a retry.

    Args:
        model: The module trained (a plain module, or DDP-wrapped).
        controller: The controller shared with the loader (``loader.controller``); a new one by
            default.
        grad_scaler: A ``torch.amp.GradScaler``; every microbatch loss is scaled by it before
            backward. Autocast stays in ``loss_fn``.
        device: Move each microbatch to this device just before its forward (the batch can
            stay in host memory, so only one microbatch occupies the device at a time; an OOM in
            the transfer is retried like any other). ``None``: the batch is used where it is.
        backward_fn: Called with each weighted microbatch loss instead of ``loss.backward()``,
            for a framework's own backward (the Lightning integration passes the strategy's,
            which applies the precision plugin's scaler and the backward hooks). Excludes
            ``grad_scaler``.
        gather: FSDP2 only (ignored otherwise): ``"attempt"`` all-gathers every module once an
            attempt (fast; the memory of DDP), ``"module"`` gathers per module as FSDP2 is
            configured (FSDP2's own memory), ``"auto"`` (default) once an attempt while the
            unsharded model leaves room, per module otherwise (see
            ``elastic_batches.distributed.gradient_sync_for``).
        memory: The memory probe ``backward`` measures each microbatch with, for the controller's
            memory model (its ``margin``): ``"auto"`` (default) takes the device's, CUDA or XPU
            (of ``device``, else of the model's parameters), none on a CPU or MPS; a
            :class:`~elastic_batches.memory.MemoryProbe` (an
            ``elastic_batches.testing.MemoryBudget`` on a CPU); ``None``: measure nothing, the
            OOM-driven search alone. ``evaluate`` never measures.

    Example:
        >>> import torch
        >>> import elastic_batches as eb
        >>> model = torch.nn.Linear(3, 1)
        >>> step = eb.ElasticStep(model, controller=eb.SplitController(split_count=3))
        >>> batch = (torch.randn(10, 3), torch.randn(10, 1))
        >>> loss = step.backward(batch, lambda mb: torch.nn.functional.mse_loss(model(mb[0]), mb[1]))
        >>> reference = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
        >>> torch.allclose(loss, reference)
        True
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        controller: SplitController | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        device: torch.device | str | None = None,
        backward_fn: Callable[[torch.Tensor], Any] | None = None,
        gather: str = "auto",
        memory: MemoryProbe | str | None = "auto",
    ) -> None:
        if gather not in GATHER_MODES:
            raise ValueError(f"ElasticStep: gather must be one of {list(GATHER_MODES)}, got {gather!r}")
        check_memory("ElasticStep", memory)
        if grad_scaler is not None and backward_fn is not None:
            raise ValueError("ElasticStep: pass grad_scaler or backward_fn, not both (backward_fn does the scaling)")
        if not isinstance(model, nn.Module):
            raise TypeError(f"ElasticStep expects an nn.Module as model, got {type(model).__qualname__}")
        if controller is not None and not isinstance(controller, SplitController):
            raise TypeError(f"ElasticStep: controller must be an elastic_batches.SplitController, got {controller!r}")
        self.model = model
        self.controller = controller if controller is not None else SplitController()
        self.grad_scaler = grad_scaler
        self.device = None if device is None else torch.device(device)
        self.backward_fn = backward_fn
        self.gather = gather
        self.memory = memory
        self._sync: GradientSync | None = None
        self.engine = AttemptEngine(self)

    @property
    def sync(self) -> GradientSync:
        """The rank-agreement and gradient-sync scheme, chosen at the first step.

        Set it before the first step to give the scheme options of its own, for instance
        ``step.sync = elastic_batches.distributed.gradient_sync_for(model, bucket_bytes=...)``.
        """
        if self._sync is None:
            self._sync = gradient_sync_for(self.model, gather=self.gather)
        return self._sync

    @sync.setter
    def sync(self, sync: GradientSync) -> None:
        if not isinstance(sync, GradientSync):
            raise TypeError(
                f"ElasticStep.sync must be a GradientSync (from elastic_batches.distributed.gradient_sync_for), "
                f"got {type(sync).__qualname__}"
            )
        if sync.model is not self.model:
            raise ValueError("ElasticStep.sync: the scheme was made for another model than the step's")
        self._sync = sync

    def backward(
        self, batch: ElasticBatch | Any, loss_fn: LossFn, *, count_fn: CountFn | None = None, unwrap: bool = True
    ) -> torch.Tensor:
        """Accumulate the gradient of the batch's mean loss, in as many microbatches as it takes.

        Everything between the start of an attempt and the ranks' vote belongs to the attempt:
        cutting (and padding) the microbatches, ``count_fn``, the device transfer, the forwards
        and backwards, summing the losses. An OOM in any of them, on any rank, is retried on
        every rank. Before a retry, everything the failed attempt changed is put back: the
        gradients, the module buffers (BatchNorm's running statistics) and the random generators
        of the CPU and of the model's device, so that the retry at ``k`` microbatches computes
        what a step run at ``k`` directly would.

        Args:
            batch: An :class:`ElasticBatch` (from a ``MicrobatchingDataLoader``) or any batch
                structure it can take apart.
            loss_fn: ``microbatch -> loss``: receives the microbatch in the user's own structure
                and returns its loss as a mean over the microbatch's samples (or over the items
                ``count_fn`` counts). Every parameter it trains must belong to ``model`` (checked
                at the first step).
            count_fn: ``microbatch -> number`` of items the microbatch's loss is a mean over (for
                instance non-ignored tokens). Microbatch weights become ``count_i / sum(counts)``
                over the batch (and over all ranks), so a token-mean loss is exact. ``None``:
                weights by rows.
            unwrap: ``False``: ``loss_fn`` receives each :class:`Microbatch` itself (its ``weight``,
                ``index`` and ``count``; ``.unwrap()`` gives the user's structure); an attempt
                starts again at ``index == 0`` after an OOM.

        Returns:
            The batch's mean loss on this rank, detached.

        Raises:
            ElasticOOMError: out of memory even at the smallest microbatch allowed (with a
                training-mode BatchNorm, 2 rows).
            RuntimeError: under several ranks, another rank's ``loss_fn`` raised (this rank
                stops too instead of waiting).
            ValueError: the batch is empty, ``loss_fn`` returned a non-scalar, or the loss
                trains tensors that are neither parameters of ``model`` nor batch tensors.
            Exception: anything else ``loss_fn`` raises, unchanged. ``.grad``, the buffers and
                the random generators are then as they were before the call; the controller
                keeps what OOMs of earlier attempts of this call taught it (the sizes that did
                not fit), and learns nothing from the failed one.
        """
        batch = ElasticBatch.wrap(batch)
        if len(batch) == 0:
            raise ValueError("ElasticStep.backward: the batch is empty (0 rows); skip empty batches before the step")
        if count_fn is None:
            buckets = batch.padding.buckets if batch.padding is not None else None
            if buckets is not None and buckets.rows is not None:
                raise ValueError(
                    f"ShapeBuckets(rows={buckets.rows!r}) pads microbatches with rows of pad values, which a "
                    "rows-weighted mean would count: pass count_fn (e.g. non-ignored labels) to "
                    "ElasticStep.backward, or use ShapeBuckets(rows=None)"
                )
        params = [p for p in self.sync.parameters() if p.requires_grad]
        work = BackwardWork(self, self.engine, batch, loss_fn, count_fn, unwrap, params, input_leaves(batch))
        stashed = [t.grad for t in work.tensors]  # the batch tensors that collect a gradient of their own too
        outer = any(grad is not None for grad in stashed)  # gradients of earlier batches, set aside
        if outer:
            for t in work.tensors:
                t.grad = None
        merged = False
        try:
            outcome, verdict = self.engine.settle(batch, work)
            self.sync.reduce(params, verdict.scale)
            if outer:
                for t, old in zip(work.tensors, stashed, strict=True):
                    if old is not None and t.grad is not None:
                        old.add_(t.grad)
                    if old is not None:
                        t.grad = old
            merged = True
            return outcome.result
        finally:
            if not merged:
                for t, old in zip(work.tensors, stashed, strict=True):
                    t.grad = old

    def evaluate(
        self,
        batch: ElasticBatch | Any,
        fn: Callable[[Any], Any],
        *,
        unwrap: bool = True,
        combine: Callable[[list[Any], list[Microbatch]], Any] | None = None,
    ) -> Any:
        """Run ``fn`` on each microbatch, without backward, retrying the batch on OOM (validation, prediction).

        The split count comes from the controller (give each stage its own: evaluation fits
        larger microbatches than training); ranks agree on each outcome as in :meth:`backward`,
        and a retry starts from the buffers and random state the call started from.
        Run it under ``torch.no_grad()`` or ``torch.inference_mode()`` as you would the plain call.

        Args:
            batch: An :class:`ElasticBatch` or any batch structure it can take apart.
            fn: ``microbatch -> output``, called on each microbatch in row order.
            unwrap: ``False``: ``fn`` receives each :class:`Microbatch` itself.
            combine: ``(outputs, microbatches) -> result``, run on the outputs of an attempt
                before the ranks agree, so that an OOM in it (concatenating predictions) is
                retried like one in ``fn``; the call then returns its result.

        Returns:
            The outputs of ``fn`` on the microbatches of the attempt that fitted, in row order
            (with ``combine``: what it returned).

        Raises:
            ElasticOOMError: out of memory even at the smallest microbatch allowed.
            RuntimeError: under several ranks, another rank's ``fn`` raised.
            Exception: anything else ``fn`` raises, unchanged.

        Example:
            >>> import torch
            >>> import elastic_batches as eb
            >>> model = torch.nn.Linear(3, 2)
            >>> step = eb.ElasticStep(model, controller=eb.SplitController(split_count=2))
            >>> x = torch.randn(5, 3)
            >>> with torch.no_grad():
            ...     outputs = step.evaluate(x, model)
            ...     whole = step.evaluate(x, model, combine=lambda outputs, microbatches: torch.cat(outputs))
            >>> [tuple(o.shape) for o in outputs], torch.allclose(whole, model(x))
            ([(3, 2), (2, 2)], True)
        """
        batch = ElasticBatch.wrap(batch)
        if len(batch) == 0:
            raise ValueError("ElasticStep.evaluate: the batch is empty (0 rows); skip empty batches before the call")

        outcome, _ = self.engine.settle(batch, EvaluateWork(self, batch, fn, unwrap, combine))
        return outcome.result

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None
    ) -> torch.Tensor | None:
        """Clip the gradients and step the optimizer, so that an OOM there on any rank raises on every rank.

        Splitting the batch cannot make the optimizer step fit, so an OOM there is final. Under
        several ranks, a rank that raises alone would leave the others waiting in their next
        collective: this method ends with one small collective in which every rank learns
        whether every other rank's step went through, and every rank raises if one did not.
        With ``max_grad_norm``, one more such collective follows the gradient norm, before any
        rank steps: an OOM in the norm leaves every rank's weights as they were. An OOM in the
        step itself is learned after it, so the ranks whose step went through keep its update
        (resume from a checkpoint rather than from this state).
        With ``grad_scaler``, it unscales, steps and updates the scaler.

        Args:
            optimizer: The optimizer over the model's parameters.
            max_grad_norm: Clip the gradients to this total 2-norm before the step, as
                ``torch.nn.utils.clip_grad_norm_`` does (over all ranks' shards under FSDP2, in
                the same collective that checks for failures). ``None``: no clipping.

        Returns:
            The total gradient 2-norm before clipping (a float64 scalar tensor), or ``None``
            without ``max_grad_norm``.

        Raises:
            ElasticOOMError: out of memory in the gradient norm or the step, on this rank or
                another; the message names the ranks.
            RuntimeError: another rank's step raised an error other than an OOM.
            ValueError: ``max_grad_norm`` is not positive.
            Exception: this rank's own error other than an OOM, unchanged.

        Example:
            >>> import torch
            >>> import elastic_batches as eb
            >>> model = torch.nn.Linear(3, 1)
            >>> step = eb.ElasticStep(model)
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> batch = (torch.randn(8, 3), torch.randn(8, 1))
            >>> _ = step.backward(batch, lambda mb: torch.nn.functional.mse_loss(model(mb[0]), mb[1]))
            >>> norm = step.optimizer_step(optimizer, max_grad_norm=1e-3)
            >>> clipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
            >>> bool(norm > 1e-3), bool(clipped < 1.1e-3)
            (True, True)
        """
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"ElasticStep.optimizer_step: max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        status, error = Status.OK, None
        try:
            if self.grad_scaler is not None:
                self.grad_scaler.unscale_(optimizer)
        except Exception as err:
            status, error = status_of(err), err
        norm = None
        if max_grad_norm is not None:  # a vote before any rank steps: an OOM on one rank leaves every rank as it was
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            norm = self.clip_grad_norm_(grads, max_grad_norm, failed=error)
        if status == Status.OK:
            try:
                if self.grad_scaler is not None:
                    self.grad_scaler.step(optimizer)
                    self.grad_scaler.update()
                else:
                    optimizer.step()
            except Exception as err:
                status, error = status_of(err), err
        raise_if_failed(self.sync.agree(status), error, "optimizer.step()")
        return norm

    def clip_grad_norm_(
        self,
        grads: Sequence[torch.Tensor],
        max_norm: float,
        *,
        failed: BaseException | None = None,
        failed_where: str = "the gradient norm",
    ) -> torch.Tensor:
        """Clip ``grads`` to a total 2-norm of ``max_norm``, as ``clip_grad_norm_`` does, the norm agreed by every rank.

        Every rank computes its part of the squared norm (all of it with replicated gradients,
        its shards' under FSDP2), and one small collective sums the parts and tells every rank
        whether any rank failed, before any gradient is scaled: an OOM in the norm on one rank
        raises ``ElasticOOMError`` on every rank, and no rank has stepped.

        Args:
            grads: The gradients to clip (this rank's shards under FSDP2).
            max_norm: The largest total norm allowed.
            failed: An error this rank met before it could clip (unscaling, a hook): it joins
                the vote all the same, so that every rank raises.
            failed_where: What the message names when some rank came with ``failed``.

        Returns:
            The total norm before clipping, a float64 scalar tensor.

        Raises:
            ElasticOOMError: out of memory in the norm (or before it) on some rank; the message
                names where and the ranks.
            RuntimeError: another rank raised an error other than an OOM.
            Exception: this rank's own error other than an OOM, unchanged.

        Example:
            >>> import torch
            >>> import elastic_batches as eb
            >>> model = torch.nn.Linear(3, 1)
            >>> step = eb.ElasticStep(model)
            >>> batch = (torch.randn(8, 3), torch.randn(8, 1))
            >>> _ = step.backward(batch, lambda mb: (model(mb[0]) - mb[1]).pow(2).mean())
            >>> grads = [p.grad for p in model.parameters()]
            >>> norm = step.clip_grad_norm_(grads, max_norm=1e-3)
            >>> bool(norm > 1e-3), bool(torch.cat([g.flatten() for g in grads]).norm() < 1.1e-3)
            (True, True)
        """
        status, error, total_sq = Status.OK, failed, 0.0
        if failed is not None:
            status = status_of(failed)
        else:
            try:
                total_sq = self.sync.local_grad_sq_norm(grads)
            except Exception as err:
                status, error = status_of(err), err
        verdict = self.sync.agree(status, total_sq, float(failed is not None))  # FSDP2: sums the shards' parts
        raise_if_failed(verdict, error, failed_where if verdict.sums[1] else "the gradient norm")
        if not self.sync.replicated:
            total_sq = verdict.sums[0]
        coefficient = max_norm / (math.sqrt(total_sq) + 1e-6)  # as torch.nn.utils.clip_grad_norm_
        if coefficient < 1.0:
            with torch.no_grad():
                torch._foreach_mul_([g.to_local() if hasattr(g, "to_local") else g for g in grads], coefficient)
        return torch.tensor(math.sqrt(total_sq), dtype=torch.float64)

"""``ElasticStep``: runs a batch as microbatches, retries it on OOM, leaves the full-batch gradient."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from elastic_batches.batch import ElasticBatch, Microbatch
from elastic_batches.controller import ElasticOOMError, SplitController
from elastic_batches.distributed import ERROR, OK, OOM, GradientSync, Outcome, Verdict, gradient_sync_for
from elastic_batches.oom import is_oom_error, release_memory

__all__ = ["ElasticStep"]

LossFn = Callable[[Any], torch.Tensor]
CountFn = Callable[[Any], "torch.Tensor | int | float"]


@dataclasses.dataclass
class _Attempt:
    status: int
    size: int  # rows of the largest microbatch
    total: float  # rows, or counted items with count_fn
    started: int  # microbatches started
    loss: torch.Tensor | None = None
    error: BaseException | None = None


def _input_leaves(batch: ElasticBatch) -> list[torch.Tensor]:
    """Leaf tensors of the batch that require grad: their ``.grad`` is set aside like the parameters'."""
    fields = batch.fields.values()
    plain = all(type(value) is torch.Tensor or type(value) is list for value in fields)
    leaves = fields if plain else batch.data.values(include_nested=True, leaves_only=True)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]


def _stop_together(sync: GradientSync, final: ElasticOOMError | None, oom: BaseException | None) -> None:
    """After an OOM, every rank learns whether any rank reached its smallest microbatch; then all raise or none.

    Ranks with different batches may reach a limit (``max_split_count``, ``min_microbatch_size``
    in tokens) at different times; this small collective runs only after an OOM, never in a
    step that fitted.
    """
    outcome = sync.agree(OOM if final is not None else OK)
    if final is not None:
        raise final from oom
    if outcome.status != OK:
        raise ElasticOOMError(
            f"rank(s) {list(outcome.oom_ranks)} ran out of memory even at their smallest microbatch; this rank "
            "stops too instead of waiting for them (see their error for what was tried)"
        ) from oom


def _raise_if_failed(outcome: Outcome, error: BaseException | None, where: str) -> None:
    """Raise on every rank when a phase that splitting cannot help failed on any rank."""
    if outcome.status == OK:
        return
    if error is not None and not is_oom_error(error):
        raise error
    if error is None and outcome.error_ranks:
        raise RuntimeError(
            f"ElasticStep.optimizer_step: rank(s) {list(outcome.error_ranks)} raised an error in {where}; "
            "this rank stops too instead of waiting for them"
        )
    raise ElasticOOMError(
        f"out of memory in {where} on rank(s) {list(outcome.oom_ranks)}: splitting the batch cannot help there, "
        "so every rank raises this error instead of waiting. Free memory for the optimizer step (optimizer "
        "state, other tensors kept alive between steps) or use a smaller model"
    ) from error


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
    ) -> None:
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
        self._sync: GradientSync | None = None

    @property
    def sync(self) -> GradientSync:
        """The rank-agreement and gradient-sync scheme, chosen at the first step."""
        if self._sync is None:
            self._sync = gradient_sync_for(self.model)
        return self._sync

    def backward(
        self, batch: ElasticBatch | Any, loss_fn: LossFn, *, count_fn: CountFn | None = None, unwrap: bool = True
    ) -> torch.Tensor:
        """Accumulate the gradient of the batch's mean loss, in as many microbatches as it takes.

        Args:
            batch: An :class:`ElasticBatch` (from a ``MicrobatchingDataLoader``) or any batch
                structure it can take apart.
            loss_fn: ``microbatch -> loss``: receives the microbatch in the user's own structure
                and returns its loss as a mean over the microbatch's samples (or over the items
                ``count_fn`` counts).
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
            ElasticOOMError: out of memory even at the smallest microbatch allowed.
            RuntimeError: under several ranks, another rank's ``loss_fn`` raised (this rank
                stops too instead of waiting).
            ValueError: the batch is empty, or ``loss_fn`` returned a non-scalar.
            Exception: anything else ``loss_fn`` raises, unchanged; ``.grad`` and the controller are
                then as they were before the call.
        """
        batch = ElasticBatch.wrap(batch)
        rows = len(batch)
        if rows == 0:
            raise ValueError("ElasticStep.backward: the batch is empty (0 rows); skip empty batches before the step")
        params = [p for p in self.sync.parameters() if p.requires_grad]
        tensors = params + _input_leaves(batch)  # and the batch tensors that collect a gradient of their own
        stashed = [t.grad for t in tensors]
        outer = any(grad is not None for grad in stashed)  # gradients of earlier batches, set aside
        if outer:
            for t in tensors:
                t.grad = None
        merged = False
        try:
            while True:
                self._check_gather("backward")
                count = self._count(batch, rows)
                attempt = self._attempt(batch, params, count, loss_fn, count_fn, unwrap)
                verdict = self.sync.vote(attempt.status, attempt.size, attempt.total, params)
                if verdict.status == OK:
                    break
                for t in tensors:
                    t.grad = None
                self.sync.discard()
                status, error, started = attempt.status, attempt.error, attempt.started
                del attempt
                self._learn_from_failure(verdict, status, error, batch, started, "backward")
                # Drop the error before collecting: its traceback keeps the failed attempt's tensors alive
                # through frames that clear_frames cannot reach (closure cells of hooked modules' forward).
                del error
                release_memory()
            self.sync.reduce(params, verdict.scale)
            if outer:
                for t, old in zip(tensors, stashed, strict=True):
                    if old is not None and t.grad is not None:
                        old.add_(t.grad)
                    if old is not None:
                        t.grad = old
            merged = True
            self.controller.record_success(verdict.size, batch.load(self.controller.unit))
            assert attempt.loss is not None
            return attempt.loss
        finally:
            if not merged:
                for t, old in zip(tensors, stashed, strict=True):
                    t.grad = old

    def evaluate(self, batch: ElasticBatch | Any, fn: Callable[[Any], Any], *, unwrap: bool = True) -> list[Any]:
        """Run ``fn`` on each microbatch, without backward, retrying the batch on OOM (validation, prediction).

        The split count comes from the controller (give each stage its own: evaluation fits
        larger microbatches than training); ranks agree on each outcome as in :meth:`backward`.
        Run it under ``torch.no_grad()`` or ``torch.inference_mode()`` as you would the plain call.

        Args:
            batch: An :class:`ElasticBatch` or any batch structure it can take apart.
            fn: ``microbatch -> output``, called on each microbatch in row order.
            unwrap: ``False``: ``fn`` receives each :class:`Microbatch` itself.

        Returns:
            The outputs of ``fn`` on the microbatches of the attempt that fitted, in row order.

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
            >>> [tuple(o.shape) for o in outputs], torch.allclose(torch.cat(outputs), model(x))
            ([(3, 2), (2, 2)], True)
        """
        batch = ElasticBatch.wrap(batch)
        rows = len(batch)
        if rows == 0:
            raise ValueError("ElasticStep.evaluate: the batch is empty (0 rows); skip empty batches before the call")
        while True:
            self._check_gather("evaluate")
            count = self._count(batch, rows)
            microbatches = list(batch.microbatches(count, balance=self.controller.unit))
            status, error, outputs, started = OK, None, [], 0
            try:
                with self.sync.microbatches():
                    for mb in microbatches:
                        started += 1
                        if self.device is not None:
                            mb = mb.to(self.device, non_blocking=True)
                        outputs.append(fn(mb.unwrap() if unwrap else mb))
            except Exception as err:
                status, error, outputs = (OOM if is_oom_error(err) else ERROR), err, []
            load = batch.load(self.controller.unit)
            verdict = self.sync.vote(status, load.size_at(count), float(rows))
            if verdict.status == OK:
                self.controller.record_success(verdict.size, load)
                return outputs
            self._learn_from_failure(verdict, status, error, batch, started, "evaluate")
            del error  # before collecting: its traceback keeps the failed attempt's tensors alive
            release_memory()

    def _learn_from_failure(
        self, verdict: Verdict, status: int, error: BaseException | None, batch: ElasticBatch, started: int, where: str
    ) -> None:
        """After a vote that failed: raise this rank's own error, stop with a failed peer, or learn from the OOM.

        Every rank calls it with the same verdict, so all raise or all retry; a split limit
        reached on one rank only stops every rank (``_stop_together``).
        """
        if error is not None and status == ERROR:
            raise error
        if verdict.status == ERROR:
            raise RuntimeError(
                f"ElasticStep.{where}: rank(s) {list(verdict.error_ranks)} raised an error other than an OOM; "
                "this rank stops too instead of waiting for them"
            )
        final: ElasticOOMError | None = None
        try:
            self.controller.record_oom(verdict.oom_size, batch.load(self.controller.unit), discarded=started)
        except ElasticOOMError as err:
            final = err
        _stop_together(self.sync, final, error)

    def _check_gather(self, where: str) -> None:
        """Raise on every rank when some rank cannot hold what an attempt gathers before its microbatches."""
        outcome = self.sync.check_gather()
        if outcome.status != OK:
            ranks = sorted(outcome.oom_ranks + outcome.error_ranks)
            raise ElasticOOMError(
                f"ElasticStep.{where}: rank(s) {ranks} cannot hold the model's gathered (unsharded) parameters "
                "that every microbatch needs; splitting the batch cannot help, so every rank raises this error "
                "instead of waiting. Free memory, use mixed precision for the parameters, or more ranks"
            )

    def _count(self, batch: ElasticBatch, rows: int) -> int:
        """The count for the next attempt: the controller's plan, unless the batch's tag asks for more.

        The loader tags each batch with the controller's settled count; a tag no higher than that
        must not block the controller's probes of a larger microbatch (refinement, ``grow_after``).
        A higher tag (set by hand, or stale from before a probe succeeded) is obeyed.
        """
        load = batch.load(self.controller.unit)
        planned = self.controller.plan(load)
        tag = batch.split_count
        if tag > planned and tag > self.controller.count_for(load):
            planned = tag
        return min(rows, planned)

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
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        status, error, total_sq = OK, None, 0.0
        try:
            if self.grad_scaler is not None:
                self.grad_scaler.unscale_(optimizer)
            if max_grad_norm is not None:
                total_sq = self.sync.local_grad_sq_norm(grads)
        except Exception as err:
            status, error = (OOM if is_oom_error(err) else ERROR), err
        if max_grad_norm is not None:
            # A vote before any rank steps: an OOM in the norm on one rank must not leave the others updated.
            outcome = self.sync.agree(status, total_sq)  # under FSDP2 it also sums the shards' parts of the norm
            _raise_if_failed(outcome, error, "the gradient norm")
            if not self.sync.replicated:
                total_sq = outcome.sums[0]
        norm = None
        if status == OK:
            try:
                if max_grad_norm is not None:
                    norm = torch.tensor(math.sqrt(total_sq), dtype=torch.float64)
                    coefficient = max_grad_norm / (math.sqrt(total_sq) + 1e-6)
                    if coefficient < 1.0:
                        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
                        with torch.no_grad():
                            torch._foreach_mul_(local, coefficient)
                if self.grad_scaler is not None:
                    self.grad_scaler.step(optimizer)
                    self.grad_scaler.update()
                else:
                    optimizer.step()
            except Exception as err:
                status, error = (OOM if is_oom_error(err) else ERROR), err
        _raise_if_failed(self.sync.agree(status), error, "optimizer.step()")
        return norm

    def _attempt(
        self,
        batch: ElasticBatch,
        params: Sequence[torch.Tensor],
        count: int,
        loss_fn: LossFn,
        count_fn: CountFn | None,
        unwrap: bool = True,
    ) -> _Attempt:
        microbatches = list(batch.microbatches(count, balance=self.controller.unit))
        size = batch.load(self.controller.unit).size_at(count)  # the largest microbatch's rows (or tokens)
        if count_fn is None:
            buckets = batch.padding.buckets if batch.padding is not None else None
            if buckets is not None and buckets.rows is not None:
                raise ValueError(
                    f"ShapeBuckets(rows={buckets.rows!r}) pads microbatches with rows of pad values, which a "
                    "rows-weighted mean would count: pass count_fn (e.g. non-ignored labels) to "
                    "ElasticStep.backward, or use ShapeBuckets(rows=None)"
                )
            total = float(len(batch))
        else:
            try:
                counts = [float(count_fn(mb.unwrap())) for mb in microbatches]
            except Exception as err:  # maybe on this rank only: the vote must still happen
                return _Attempt(OOM if is_oom_error(err) else ERROR, size, 0.0, 0, error=err)
            total = sum(counts)
            microbatches = [
                mb.reweighted(c / total if total else 0.0) for mb, c in zip(microbatches, counts, strict=True)
            ]
        started = 0
        losses: list[torch.Tensor] = []  # weighted and detached; summed once, not once per microbatch
        try:
            with self.sync.microbatches():
                for mb in microbatches:
                    started += 1
                    if mb.weight == 0.0:
                        continue  # nothing to count in it: its loss would be 0/0
                    losses.append(self._run(mb, loss_fn, unwrap))
            self.sync.prepare(params)  # what the gradient reduction allocates, allocated before the vote
        except Exception as err:
            status = OOM if is_oom_error(err) else ERROR
            return _Attempt(status, size, total, started, error=err)
        if count_fn is not None and not total:
            loss = torch.full((), math.nan)
        else:
            loss = torch.stack(losses).sum() if len(losses) > 1 else losses[0]
        return _Attempt(OK, size, total, started, loss=loss)

    def _run(self, mb: Microbatch, loss_fn: LossFn, unwrap: bool = True) -> torch.Tensor:
        if self.device is not None:
            mb = mb.to(self.device, non_blocking=True)
        loss = loss_fn(mb.unwrap() if unwrap else mb)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__qualname__
            raise ValueError(f"loss_fn must return a scalar loss tensor (a mean over the microbatch), got {shape}")
        weighted = loss * mb.weight
        if self.backward_fn is not None:
            self.backward_fn(weighted)
        elif self.grad_scaler is not None:
            self.grad_scaler.scale(weighted).backward()
        else:
            weighted.backward()
        return weighted.detach()

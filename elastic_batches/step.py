"""``ElasticStep``: runs a batch as microbatches, retries it on OOM, leaves the full-batch gradient."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from elastic_batches._measuring import Meter, measured_pieces
from elastic_batches._warnings import warn_on_rank_zero, warn_once
from elastic_batches.balance import BatchLoad
from elastic_batches.batch import ElasticBatch, Microbatch
from elastic_batches.controller import SplitController
from elastic_batches.distributed import GATHER_MODES, Ballot, GradientSync, Verdict, gradient_sync_for
from elastic_batches.memory import MemoryProbe, MemoryReading, check_memory, device_probe
from elastic_batches.oom import ElasticOOMError, Status, clear_error, is_oom_error, release_memory, status_of
from elastic_batches.rollback import Rollback
from elastic_batches.structures import constant_tensors

__all__ = ["ElasticStep"]

_CPU = torch.device("cpu")
LossFn = Callable[[Any], torch.Tensor]
CountFn = Callable[[Any], "torch.Tensor | int | float"]


@dataclasses.dataclass
class _Attempt:
    """One attempt at a batch, from the cut to the vote; whatever it raises is kept in ``error``."""

    size: int  # the largest microbatch (rows, or the controller's unit)
    total: float = 0.0  # rows, or counted items with count_fn
    started: int = 0  # microbatches started
    status: Status = Status.OK
    result: Any = None  # backward: the weighted loss; evaluate: the outputs
    error: BaseException | None = None
    meter: Meter | None = None  # the memory measured around its microbatches
    lead: int = 0  # rows of a first, measuring microbatch (0: cut as planned)
    rescale: float = 1.0  # measuring with a count_fn whose counts did not add up: the gradients' correction
    sizes: list[int] = dataclasses.field(default_factory=list)  # rows of each microbatch cut
    smallest: int = 1  # the fewest rows a microbatch may have (min_microbatch_size, the BatchNorm floor)


def _input_leaves(batch: ElasticBatch) -> list[torch.Tensor]:
    """Leaf tensors of the batch that require grad, each once: their ``.grad`` is set aside like the parameters'.

    The broadcast (0-d) tensors count too: every microbatch adds to their gradient.
    """
    fields = batch.fields.values()
    plain = all(type(value) is torch.Tensor or type(value) is list for value in fields)
    values = fields if plain else batch.data.values(include_nested=True, leaves_only=True)
    leaves = [t for t in values if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
    leaves += [t for t in constant_tensors(batch.spec) if t.requires_grad and t.is_leaf]
    return list({id(t): t for t in leaves}.values()) if len(leaves) > 1 else leaves


def _graph_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose ``.grad`` a backward of ``loss`` accumulates into (its autograd graph's leaves)."""
    leaves, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _stop_together(
    sync: GradientSync, final: ElasticOOMError | None, oom: BaseException | None, controller: SplitController
) -> None:
    """After an OOM, every rank learns whether any rank reached its smallest microbatch; then all raise or none.

    Ranks with different batches may reach a limit (``max_split_count``, ``min_microbatch_size``
    in tokens) at different times; this small collective runs only after an OOM, never in a
    step that fitted. Where the scheme can switch to one that holds less memory (FSDP2
    ``gather="auto"``), every rank does instead of raising, and the controller forgets the sizes
    that failed under the old one.
    """
    outcome = sync.agree(Status.OOM if final is not None else Status.OK)
    if (final is not None or outcome.status != Status.OK) and sync.fall_back():
        controller.forget_sizes()
        return
    if final is not None:
        raise final from oom
    if outcome.status != Status.OK:
        raise ElasticOOMError(
            f"rank(s) {list(outcome.oom_ranks)} ran out of memory even at their smallest microbatch; this rank "
            "stops too instead of waiting for them (see their error for what was tried)"
        ) from oom


def _raise_if_failed(outcome: Verdict, error: BaseException | None, where: str) -> None:
    """Raise on every rank when a phase that splitting cannot help failed on any rank."""
    if outcome.status == Status.OK:
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
        self._probe: MemoryProbe | None = None  # resolved at the first backward
        self._sync: GradientSync | None = None
        self._rollback = Rollback(model)
        self._batchnorms: list[tuple[str, nn.Module]] | None = None  # listed when a batch is first split
        self._warned_batchnorm = False
        self._graph_checked = False  # the first loss's autograd graph was checked for foreign parameters
        self._devices_key: tuple[torch.device | None, torch.device | None] | None = None
        self._devices_seen: tuple[torch.device, ...] = ()
        self._said: set[str] = set()  # the fall-backs to the search already warned about

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
        leaves = _input_leaves(batch)
        tensors = params + leaves  # the batch tensors that collect a gradient of their own too
        stashed = [t.grad for t in tensors]
        outer = any(grad is not None for grad in stashed)  # gradients of earlier batches, set aside
        if outer:
            for t in tensors:
                t.grad = None

        def run(attempt: _Attempt) -> None:
            attempt.result = self._backward_microbatches(attempt, batch, loss_fn, count_fn, unwrap, leaves)
            if attempt.rescale != 1.0:  # the weights of a measured attempt divided by another total than the real
                torch._foreach_mul_([t.grad for t in tensors if t.grad is not None], attempt.rescale)
                attempt.result = attempt.result * attempt.rescale
            self.sync.prepare(params)  # what the gradient reduction allocates, allocated before the vote

        def forget() -> None:
            for t in tensors:
                t.grad = None
            self.sync.discard()

        merged = False
        try:
            attempt, verdict = self._settle(batch, "backward", run, forget, params)
            self.sync.reduce(params, verdict.scale)
            if outer:
                for t, old in zip(tensors, stashed, strict=True):
                    if old is not None and t.grad is not None:
                        old.add_(t.grad)
                    if old is not None:
                        t.grad = old
            merged = True
            return attempt.result
        finally:
            if not merged:
                for t, old in zip(tensors, stashed, strict=True):
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

        def run(attempt: _Attempt) -> None:
            attempt.total = float(len(batch))
            outputs, ran = [], []
            with self.sync.microbatches():
                for mb in batch.microbatches(sizes=attempt.sizes):
                    attempt.started += 1
                    ran.append(mb)
                    if self.device is not None:
                        mb = mb.to(self.device, non_blocking=True)
                    outputs.append(fn(mb.unwrap() if unwrap else mb))
            attempt.result = outputs if combine is None else combine(outputs, ran)

        attempt, _ = self._settle(batch, "evaluate", run, None, None)
        return attempt.result

    def _settle(
        self,
        batch: ElasticBatch,
        where: str,
        run: Callable[[_Attempt], None],
        forget: Callable[[], None] | None,
        params: Sequence[torch.Tensor] | None,
    ) -> tuple[_Attempt, Verdict]:
        """The retry engine: attempts of ``batch`` until one fits on every rank; the attempt and its verdict.

        ``run(attempt)`` does the work of one attempt (cut as ``attempt.sizes`` says, or measured);
        whatever it raises becomes the attempt's outcome, which every rank votes on. After a failed
        vote, ``forget`` drops the attempt's gradients, the buffers and random generators are
        restored, and the controller learns (or every rank raises together).
        """
        self._check_tag(batch)
        load = batch.load(self.controller.unit)
        tag = batch.split_count
        probe = self._memory_probe() if where == "backward" else None
        model = self.controller.memory if probe is not None else None
        learned = None if model is None else model.state_dict()  # put back unless an OOM taught it
        smallest = self.controller.smallest_rows(self._batchnorm_floor())
        saved = False
        first = True  # only the first attempt of a call measures: a retry is planned from what it learned
        try:
            while True:
                self._check_gather(where)
                reading = self._reading(probe)
                count = self.controller.plan(load, tag=tag, memory=reading)
                lead = self.controller.measurement(load, smallest=smallest) if reading is not None and first else 0
                first = False
                count, lead = self.sync.agree_plan(count, lead, where)
                attempt = _Attempt(size=0, smallest=smallest)
                if not lead:
                    attempt.sizes = load.sizes(count, min_rows=smallest)  # the BatchNorm floor too
                    attempt.size = load.largest(attempt.sizes)
                if reading is not None:
                    assert probe is not None and model is not None
                    attempt.meter = Meter(probe, model, reading)
                    attempt.lead = lead
                try:
                    if not saved:  # inside the attempt: what saving allocates is the attempt's
                        self._rollback.save(self._devices(params))
                        saved = True
                    if len(attempt.sizes) > 1 or attempt.lead:
                        how = "measured in pieces" if attempt.lead else f"now into {len(attempt.sizes)} microbatches"
                        self._warn_batchnorm(how)
                    run(attempt)
                except Exception as err:  # maybe on this rank only: the vote must still happen
                    attempt.status, attempt.error, attempt.result = status_of(err), err, None
                capacity = self._forecast(attempt)
                verdict = self.sync.vote(Ballot(attempt.status, attempt.size, attempt.total, capacity), params)
                if verdict.status == Status.OK:
                    self._rollback.commit()
                    if capacity and not verdict.capacity:
                        self._say_once(
                            "a peer predicts nothing",
                            "some rank has no memory prediction (no probe, or "
                            "nothing measured yet): every rank plans from the OOM-driven search until all do",
                        )
                    pieces = attempt.sizes or None
                    self.controller.record_success(verdict.size, load, capacity=verdict.capacity, pieces=pieces)
                    return attempt, verdict
                if forget is not None:
                    forget()
                self._rollback.restore()
                if verdict.again:  # void, though nothing failed: the same plan again, nothing learned
                    del attempt
                    continue
                status, error, started = attempt.status, attempt.error, attempt.started
                attempt.error = attempt.meter = None  # the error's frames hold the attempt: a reference cycle
                del attempt
                self._learn_from_failure(verdict, status, error, batch, started, where)
                clear_error(error)  # its frames held the attempt, and the attempt it: that cycle is broken
                del error
                release_memory()
                if model is not None:
                    learned = model.state_dict()  # what this OOM taught is kept
        except BaseException as err:
            if saved:
                self._rollback.restore()
                self._rollback.forget()
            if learned is not None and model is not None and not isinstance(err, ElasticOOMError):
                model.load_state_dict(learned)  # an error or an interrupt: nothing learned from the failed attempt
            raise
        finally:
            if probe is not None:
                probe.finish()  # the device's peak statistics as the user would see them without the windows

    def _memory_probe(self) -> MemoryProbe | None:
        """The probe ``backward`` measures with, or ``None`` (no probe, or the controller predicts nothing)."""
        model = self.controller.memory
        if model is None or not model.enabled or self.memory is None:
            return None
        if isinstance(self.memory, MemoryProbe):
            return self.memory
        if self._probe is None:
            first = next(iter(self.sync.parameters()), None)
            device = self.device if self.device is not None else None if first is None else first.device
            self._probe = device_probe(device)
            if self._probe is None:
                self.memory = None  # no probe for this device: not looked for again
                model.unprobed = "this device" if device is None else str(device)
        return self._probe

    def _forecast(self, attempt: _Attempt) -> int:
        """After an attempt, before the vote: what the model learned from it, and its prediction for the next."""
        meter = attempt.meter
        if meter is None:
            return 0
        try:
            if attempt.error is not None:
                meter.failed(attempt.error)
            return self.controller.forecast(meter.reading())
        except Exception:  # a probe that fails must not keep this rank from the vote: predict nothing
            return 0

    def _batchnorm_floor(self) -> int:
        """The fewest rows a microbatch may have for the model: 2 through a training-mode BatchNorm, else 1."""
        return 2 if any(m.training for _, m in self._batchnorm_layers()) else 1

    def _reading(self, probe: MemoryProbe | None) -> MemoryReading | None:
        """The probe's reading before an attempt, or ``None`` where it cannot plan (said once each way).

        ``None`` too when the probe raises or reports no room at all (more in use than its
        capacity): the search plans that attempt, and the model learns nothing from it.
        """
        if probe is None:
            return None
        try:
            reading = probe.memory_reading()
        except Exception as err:
            self._say_once(
                "probe raised",
                f"the memory probe {probe!r} raised {type(err).__name__}: {err}; the batches it cannot "
                "measure are planned by the OOM-driven search",
            )
            return None
        if reading.capacity is None:
            return None  # nothing limits memory: nothing to predict
        if reading.in_use >= reading.capacity:
            self._say_once(
                "no room",
                f"the memory probe {probe!r} reports {reading.in_use} bytes in use, at or above its capacity "
                f"of {reading.capacity} bytes; the batches it reports so are planned by the OOM-driven search",
            )
            return None
        return reading

    def _say_once(self, key: str, message: str) -> None:
        """Warn ``message`` once per step object (on rank zero), for one kind of fall-back to the search."""
        if key not in self._said:
            self._said.add(key)
            warn_on_rank_zero(f"elastic_batches: ElasticStep: {message}", stacklevel=5)

    def _backward_microbatches(
        self,
        attempt: _Attempt,
        batch: ElasticBatch,
        loss_fn: LossFn,
        count_fn: CountFn | None,
        unwrap: bool,
        leaves: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """Forward and backward of every microbatch of one attempt; the batch's mean loss (detached)."""
        losses: list[torch.Tensor] = []  # weighted and detached; summed once, not once per microbatch
        meter = attempt.meter
        with self.sync.microbatches():
            microbatches: Iterable[Microbatch]
            if meter is not None and attempt.lead:
                microbatches = measured_pieces(
                    batch, self.controller, self.sync, meter, attempt.lead, attempt.smallest, count_fn, attempt
                )
            else:
                microbatches = batch.microbatches(sizes=attempt.sizes)
                if count_fn is None:
                    attempt.total = float(len(batch))
                else:
                    cut = list(microbatches)
                    counts = [float(count_fn(mb.unwrap())) for mb in cut]
                    attempt.total = total = math.fsum(counts)
                    microbatches = [
                        mb.reweighted(c / total if total else 0.0) for mb, c in zip(cut, counts, strict=True)
                    ]
                self.sync.weigh(attempt.total)
                if meter is not None:
                    microbatches = self._windowed(microbatches, batch, attempt.sizes, meter)
            measuring = meter is not None and bool(attempt.lead)  # cut as it goes: which one is last is unknown
            for mb in microbatches:
                attempt.started += 1
                if mb.weight == 0.0:
                    if meter is not None:
                        meter.skip()
                    continue  # nothing to count in it: its loss would be 0/0
                if not measuring and mb.index == mb.count - 1:
                    self.sync.last_microbatch()  # DDP: its backward starts the gradient buckets' all-reduce
                losses.append(self._run(mb, loss_fn, unwrap, leaves, meter))
                if meter is not None:
                    meter.end()
            if not losses:
                return torch.full((), math.nan)
            return torch.stack(losses).sum() if len(losses) > 1 else losses[0]

    def _windowed(
        self, microbatches: Iterable[Microbatch], batch: ElasticBatch, sizes: Sequence[int], meter: Meter
    ) -> Iterator[Microbatch]:
        """``microbatches`` (the planned cut, of ``sizes`` rows), each taken inside its memory window."""
        load = batch.load(self.controller.unit)
        pieces = iter(microbatches)
        start = 0
        for rows in sizes:
            meter.begin(load.cost(start, start + rows))
            yield next(pieces)
            start += rows

    def _learn_from_failure(
        self,
        verdict: Verdict,
        status: Status,
        error: BaseException | None,
        batch: ElasticBatch,
        started: int,
        where: str,
    ) -> None:
        """After a vote that failed: raise this rank's own error, stop with a failed peer, or learn from the OOM.

        Every rank calls it with the same verdict, so all raise or all retry; a split limit
        reached on one rank only stops every rank (``_stop_together``).
        """
        if error is not None and status == Status.ERROR:
            raise error
        if verdict.status == Status.ERROR:
            raise RuntimeError(
                f"ElasticStep.{where}: rank(s) {list(verdict.error_ranks)} raised an error other than an OOM; "
                "this rank stops too instead of waiting for them"
            )
        final: ElasticOOMError | None = None
        load = batch.load(self.controller.unit)
        try:
            self.controller.record_oom(verdict.oom_size, load, discarded=started, capacity=verdict.capacity)
            final = self._batchnorm_limit(load, batch.split_count, verdict.oom_size)
        except ElasticOOMError as err:
            final = err
        _stop_together(self.sync, final, error, self.controller)

    def _check_gather(self, where: str) -> None:
        """Raise on every rank when some rank cannot hold what an attempt gathers before its microbatches."""
        outcome = self.sync.check_gather()
        if outcome.status != Status.OK:
            ranks = sorted(outcome.oom_ranks + outcome.error_ranks)
            raise ElasticOOMError(
                f"ElasticStep.{where}: rank(s) {ranks} cannot hold the model's gathered (unsharded) parameters "
                "that every microbatch needs; splitting the batch cannot help, so every rank raises this error "
                "instead of waiting. Free memory, use mixed precision for the parameters, or more ranks"
            )

    def _check_tag(self, batch: ElasticBatch) -> None:
        """Warn when the batch was tagged by another controller: what this step learns would never reach the loader."""
        source = batch.tagged_by
        if source is not None and source is not self.controller:
            warn_once(
                "elastic_batches: ElasticStep got a batch tagged by another SplitController than its own: what the "
                "step learns (the split count) never reaches the loader, nor its state_dict, so a resumed run runs "
                "out of memory its way down again. Share the loader's: "
                "ElasticStep(model, controller=loader.controller)",
                stacklevel=4,
            )

    def _devices(self, params: Sequence[torch.Tensor] | None) -> tuple[torch.device, ...]:
        """The devices whose random generators a microbatch may draw from: the CPU, the model's and ``device``."""
        first = params[0] if params else next(iter(self.sync.parameters()), None)
        key = (None if first is None else first.device, self.device)
        if key != self._devices_key:
            self._devices_key = key
            self._devices_seen = tuple(dict.fromkeys(d for d in (_CPU, *key) if d is not None))
        return self._devices_seen

    def _batchnorm_layers(self) -> list[tuple[str, nn.Module]]:
        """The model's BatchNorm layers with their names, listed once."""
        if self._batchnorms is None:
            self._batchnorms = [(name, m) for name, m in self.model.named_modules() if isinstance(m, _BatchNorm)]
        return self._batchnorms

    def _training_batchnorms(self) -> list[str]:
        """``Type 'name'`` of each BatchNorm layer of the model in training mode."""
        return [f"{type(m).__name__} {name!r}" for name, m in self._batchnorm_layers() if m.training]

    def _warn_batchnorm(self, how: str) -> None:
        """Say once per step object that splitting changes the statistics of training-mode BatchNorm layers."""
        if self._warned_batchnorm:
            return
        norms = self._training_batchnorms()
        if norms:
            self._warned_batchnorm = True
            warn_on_rank_zero(
                f"elastic_batches: {type(self.model).__name__} has BatchNorm layers in training mode "
                f"({', '.join(norms)}) and its batches are split ({how}): their batch "
                "statistics, and the running statistics, are computed per microbatch, not over the whole batch. Use "
                "GroupNorm or LayerNorm where whole-batch statistics matter",
                stacklevel=4,
            )

    def _batchnorm_limit(self, load: BatchLoad, tag: int, size: int) -> ElasticOOMError | None:
        """The final error when the next count would cut a microbatch of one row through a training-mode BatchNorm."""
        count = self.controller.plan(load, tag=tag)
        if load.rows < 2 or min(load.sizes(count)) >= 2:
            return None
        norms = self._training_batchnorms()
        if not norms:
            return None
        return ElasticOOMError(
            f"out of memory on a batch of {load.rows} rows at microbatch size {size}, and the next split would cut "
            f"microbatches of 1 row, which {', '.join(norms)} cannot normalise in training mode (batch statistics "
            "need 2 rows or more): for a model with training-mode BatchNorm, ElasticStep stops where "
            "min_microbatch_size=2 would. Lower the batch size, free memory, or use GroupNorm or LayerNorm"
        )

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
        _raise_if_failed(self.sync.agree(status), error, "optimizer.step()")
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
        _raise_if_failed(verdict, error, failed_where if verdict.sums[1] else "the gradient norm")
        if not self.sync.replicated:
            total_sq = verdict.sums[0]
        coefficient = max_norm / (math.sqrt(total_sq) + 1e-6)  # as torch.nn.utils.clip_grad_norm_
        if coefficient < 1.0:
            with torch.no_grad():
                torch._foreach_mul_([g.to_local() if hasattr(g, "to_local") else g for g in grads], coefficient)
        return torch.tensor(math.sqrt(total_sq), dtype=torch.float64)

    def _run(
        self,
        mb: Microbatch,
        loss_fn: LossFn,
        unwrap: bool,
        leaves: Sequence[torch.Tensor],
        meter: Meter | None = None,
    ) -> torch.Tensor:
        if self.device is not None:
            mb = mb.to(self.device, non_blocking=True)
        loss = loss_fn(mb.unwrap() if unwrap else mb)
        if meter is not None:
            meter.forward_done()
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__qualname__
            raise ValueError(f"loss_fn must return a scalar loss tensor (a mean over the microbatch), got {shape}")
        if not self._graph_checked:
            self._check_graph(loss, leaves)
        weighted = loss * mb.weight
        if self.backward_fn is not None:
            self.backward_fn(weighted)
        elif self.grad_scaler is not None:
            self.grad_scaler.scale(weighted).backward()
        else:
            weighted.backward()
        return weighted.detach()

    def _check_graph(self, loss: torch.Tensor, leaves: Sequence[torch.Tensor]) -> None:
        """Refuse a loss that trains tensors outside ``model`` and the batch: their gradients would survive a retry."""
        if loss.grad_fn is None:
            return
        known = {id(t) for t in leaves} | self.sync.graph_leaf_ids()
        foreign = [t for t in _graph_leaves(loss) if id(t) not in known]
        if foreign:
            shapes = ", ".join(str(tuple(t.shape)) for t in foreign[:8])
            raise ValueError(
                f"ElasticStep: loss_fn trains {len(foreign)} tensor(s) that are neither parameters of the model given "
                f"to ElasticStep ({type(self.model).__name__}) nor tensors of the batch (shapes {shapes}): their "
                "gradients could not be set aside and restored around an OOM retry. Give ElasticStep the module that "
                "holds every parameter loss_fn trains (for instance the whole model, not a part of it)"
            )
        self._graph_checked = True

"""The attempt engine: the attempts at one batch, until one fits on every rank.

Each attempt goes through the same phases, one method each: :meth:`AttemptEngine.plan` (the
controller's :class:`~elastic_batches.plan.Plan`, amended by the ranks' agreement), ``run`` (save
what a failure must restore, then the :class:`Work`'s microbatches; whatever it raises becomes
the attempt's :class:`Outcome`), ``vote`` (every rank learns every rank's outcome), then either
``commit`` (the controller learns the success) or ``restore`` and ``learn`` (the controller
learns the OOM, or every rank raises together) and ``release`` (the failed attempt's memory,
before the retry). ``ElasticStep.backward`` and ``evaluate`` hand it their :class:`Work`.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from elastic_batches._warnings import warn_on_rank_zero, warn_once
from elastic_batches.batch import ElasticBatch
from elastic_batches.batchnorm import BatchNormPolicy
from elastic_batches.controller import SplitController
from elastic_batches.distributed import Ballot, GradientSync, Verdict
from elastic_batches.distributed.guard import PeerFailure
from elastic_batches.memory import MemoryModel, MemoryProbe, MemoryReading, active_probe, devices_probe
from elastic_batches.memory.meter import Meter
from elastic_batches.memory.shortfall import Shortfall
from elastic_batches.oom import (
    ElasticOOMError,
    Status,
    clear_error,
    is_oom_error,
    release_memory,
    requested_bytes,
    status_of,
)
from elastic_batches.plan import Plan
from elastic_batches.rollback import Rollback

__all__ = ["AttemptEngine", "Outcome", "Progress", "StepSettings", "Work", "raise_if_failed"]

_CPU = torch.device("cpu")


def batch_devices(batch: ElasticBatch) -> tuple[torch.device, ...]:
    """The devices the batch's tensor fields are on, each once."""
    return tuple(dict.fromkeys(v.device for v in batch.fields.values() if isinstance(v, torch.Tensor)))


class StepSettings(Protocol):
    """What the engine and its work read of their :class:`~elastic_batches.ElasticStep`."""

    model: nn.Module
    controller: SplitController
    device: torch.device | None
    memory: MemoryProbe | str | None
    backward_fn: Callable[[torch.Tensor], Any] | None
    grad_scaler: torch.amp.GradScaler | None

    @property
    def sync(self) -> GradientSync: ...


class Progress:
    """What one attempt has done so far, written by its :class:`Work` as it cuts and runs."""

    __slots__ = ("rescale", "size", "sizes", "started", "total")

    def __init__(self, plan: Plan) -> None:
        self.size = plan.largest  # the largest microbatch cut (in the controller's unit)
        self.sizes: tuple[int, ...] = plan.sizes  # rows of each microbatch (a measured cut: known at its end)
        self.total = 0.0  # rows, or counted items with count_fn
        self.started = 0  # microbatches started
        self.rescale = 1.0  # measured with a count_fn whose counts did not add up: the gradients' correction


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """What one attempt came to on this rank, before the vote."""

    status: Status
    size: int  # the largest microbatch cut (in the controller's unit)
    total: float  # rows, or counted items with count_fn
    started: int  # microbatches started
    sizes: tuple[int, ...]  # rows of each microbatch cut
    capacity: int  # the largest microbatch the memory model predicts fits the next attempt (0: none)
    result: Any = None  # backward: the batch's mean loss; evaluate: the outputs
    error: BaseException | None = None


class Work(Protocol):
    """What an attempt runs: the microbatches of ``backward`` or of ``evaluate``."""

    @property
    def where(self) -> str:
        """``"backward"`` or ``"evaluate"``: the attempt's kind, as messages and the ranks' scripts name it."""
        ...

    @property
    def params(self) -> Sequence[torch.Tensor] | None:
        """The parameters whose gradients the vote reduces (``None``: evaluation)."""
        ...

    def run(self, plan: Plan, meter: Meter | None, progress: Progress) -> Any:
        """The microbatches of one attempt, cut as ``plan`` says; what the call returns."""
        ...

    def discard(self) -> None:
        """Drop what a failed attempt left (its gradients)."""
        ...


@dataclasses.dataclass
class _Call:
    """One call's attempts: the batch, and what the engine keeps across them."""

    batch: ElasticBatch
    work: Work
    load: Any  # the batch's BatchLoad in the controller's unit
    probe: MemoryProbe | None
    learned: dict[str, Any] | None  # the memory model before the call: put back unless an OOM taught it
    floor: int  # the BatchNorm floor
    watch: MemoryProbe | None = None  # what the error at the limit reads (the step's probe, or an active budget)
    before: MemoryReading | None = None  # its reading before the first attempt
    held: int | None = None  # its bytes in use when this rank's last attempt ran out
    saved: bool = False
    first: bool = True  # only the first attempt of a call measures: a retry is planned from what it learned


class AttemptEngine:
    """The retry loop of one :class:`~elastic_batches.ElasticStep`: what it keeps between calls, and the phases.

    Args:
        step: The step whose model, controller, gradient sync and memory setting it uses.
    """

    def __init__(self, step: StepSettings) -> None:
        # The step owns its engine: a strong reference back would make a cycle that keeps the model (and a DDP
        # model's process group) alive until the garbage collector runs, or until the interpreter exits.
        self._step = weakref.ref(step)
        self.rollback = Rollback(step.model)
        self.batchnorm = BatchNormPolicy(step.model)
        self.graph_checked = False  # the first loss's autograd graph was checked for foreign parameters
        self._probe: MemoryProbe | None = None  # the device's, resolved at the first backward
        self._device: str | None = None  # the device it was looked for on (once looked for)
        self._said: set[str] = set()  # the fall-backs to the search already warned about
        self._devices_key: tuple[int, torch.device | None, torch.device | None] | None = None
        self._devices: tuple[torch.device, ...] = ()

    @property
    def step(self) -> StepSettings:
        step = self._step()
        if step is None:
            raise RuntimeError("AttemptEngine: its ElasticStep is gone; an engine runs only for the step that made it")
        return step

    def __getstate__(self) -> dict[str, Any]:
        # Copied or pickled with its step, the engine refers to the copy of the step (the memo sees the same object).
        return {**self.__dict__, "_step": self.step}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _step=weakref.ref(state["_step"]))

    @property
    def controller(self) -> SplitController:
        return self.step.controller

    @property
    def sync(self) -> GradientSync:
        return self.step.sync

    def settle(self, batch: ElasticBatch, work: Work) -> tuple[Outcome, Verdict]:
        """Attempts at ``batch`` until one fits on every rank: that attempt's outcome and its verdict.

        Raises:
            ElasticOOMError: out of memory at the smallest microbatch allowed (on every rank).
            Exception: what :meth:`learn` raises: this rank's own error, or a peer's failure.
        """
        self._check_tag(batch)
        probe = self._memory_probe(batch) if work.where == "backward" else None
        model = self._model(probe)
        call = _Call(
            batch,
            work,
            batch.load(self.controller.unit),
            probe,
            None if model is None else model.state_dict(),
            self.batchnorm.floor(),
        )
        call.watch = self._watching(probe)
        call.before = _read(call.watch)
        try:
            while True:
                plan, meter = self.plan(call)
                outcome = self.run(call, plan, meter)
                del meter
                verdict = self.vote(call, outcome)
                if verdict.status == Status.OK:
                    self.commit(call, outcome, verdict)
                    return outcome, verdict
                self.restore(call)
                if verdict.again:  # void, though nothing failed: the same plan again, nothing learned
                    continue
                status, error, started = outcome.status, outcome.error, outcome.started
                del outcome  # it holds the error, whose frames hold the attempt's tensors
                self.learn(call, verdict, status, error, started)
                clear_error(error)
                del error
                self.release(call)
        except BaseException as err:
            self.abandon(call, err)
            raise
        finally:
            if probe is not None:
                probe.finish()  # the device's peak statistics as the user would see them without the windows

    # -- the phases -----------------------------------------------------------------------------

    def plan(self, call: _Call) -> tuple[Plan, Meter | None]:
        """The plan of the next attempt, agreed by the ranks, and the meter that measures it (or none)."""
        self._check_gather(call.work.where)
        reading = self._reading(call.probe)
        plan = self.controller.plan_attempt(
            call.load, tag=call.batch.split_count, memory=reading, measure=call.first, floor=call.floor
        )
        call.first = False
        plan = self.sync.agree_plan(plan, call.work.where)
        model = self._model(call.probe)
        if reading is None or model is None or call.probe is None:
            return plan, None
        return plan, Meter(call.probe, model, reading, measuring=plan.measuring)

    def run(self, call: _Call, plan: Plan, meter: Meter | None) -> Outcome:
        """Save what a failure must restore (once a call, inside the attempt), then run the work's microbatches."""
        progress = Progress(plan)
        status, error, result = Status.OK, None, None
        try:
            if not call.saved:  # inside the attempt: what saving allocates is the attempt's
                self.rollback.save(self.devices(call.work.params, call.batch))
                call.saved = True
            if len(plan.sizes) > 1 or plan.measuring:
                self.batchnorm.warn(
                    "measured in pieces" if plan.measuring else f"now into {len(plan.sizes)} microbatches"
                )
            result = call.work.run(plan, meter, progress)
        except Exception as err:  # maybe on this rank only: the vote must still happen
            status, error = status_of(err), err
        reading = _read(call.watch) if status == Status.OOM and call.before is not None else None
        call.held = None if reading is None else reading.in_use  # the failed attempt's tensors are alive yet
        capacity = self._forecast(meter, error)
        return Outcome(status, progress.size, progress.total, progress.started, progress.sizes, capacity, result, error)

    def vote(self, call: _Call, outcome: Outcome) -> Verdict:
        """Every rank learns every rank's outcome (the gradients' reduction rides along where it can)."""
        ballot = Ballot(outcome.status, outcome.size, outcome.total, outcome.capacity)
        return self.sync.vote(ballot, call.work.params)

    def commit(self, call: _Call, outcome: Outcome, verdict: Verdict) -> None:
        """The attempt fitted on every rank: what was saved is dropped, and the controller learns the success."""
        self.rollback.commit()
        if outcome.capacity and not verdict.capacity:
            self._say_once(
                "a peer predicts nothing",
                "some rank has no memory prediction (no probe, or "
                "nothing measured yet): every rank plans from the OOM-driven search until all do",
            )
        pieces = list(outcome.sizes) or None
        self.controller.record_success(verdict.size, call.load, capacity=verdict.capacity, pieces=pieces)

    def restore(self, call: _Call) -> None:
        """The attempt failed on some rank: its gradients are dropped, the buffers and random state put back."""
        call.work.discard()
        self.rollback.restore()

    def learn(self, call: _Call, verdict: Verdict, status: Status, error: BaseException | None, started: int) -> None:
        """After a vote that failed: raise this rank's own error, stop with a failed peer, or learn from the OOM.

        Every rank calls it with the same verdict, so all raise or all retry; a split limit
        reached on one rank only stops every rank (:meth:`_stop_together`).
        """
        where = call.work.where
        if error is not None and status == Status.ERROR:
            raise error
        if verdict.status == Status.ERROR:
            raise RuntimeError(
                f"ElasticStep.{where}: rank(s) {list(verdict.error_ranks)} raised an error other than an OOM; "
                "this rank stops too instead of waiting for them"
            )
        final: ElasticOOMError | None = None
        try:
            self.controller.record_oom(verdict.oom_size, call.load, discarded=started, capacity=verdict.capacity)
            sizes = self.controller.plan_attempt(call.load, tag=call.batch.split_count).sizes
            final = self.batchnorm.limit(call.load, list(sizes), verdict.oom_size)
        except ElasticOOMError as err:
            final = err
        if final is not None:
            final = self._explained(final, call, verdict.oom_size, error)
        self._stop_together(final, error)

    def release(self, call: _Call) -> None:
        """Before the retry: the failed attempt's memory is handed back, and what its OOM taught the model kept."""
        release_memory()
        model = self._model(call.probe)
        if model is not None:
            call.learned = model.state_dict()

    def abandon(self, call: _Call, err: BaseException) -> None:
        """The call raises: the model's state as the call found it, the model as before unless an OOM taught it."""
        if call.saved:
            self.rollback.restore()
            self.rollback.forget()
        model = self._model(call.probe)
        if call.learned is not None and model is not None and not isinstance(err, ElasticOOMError):
            model.load_state_dict(call.learned)  # an error or an interrupt: nothing learned from the failed attempt

    # -- what the phases ask --------------------------------------------------------------------

    def devices(
        self, params: Sequence[torch.Tensor] | None, batch: ElasticBatch | None = None
    ) -> tuple[torch.device, ...]:
        """The devices a microbatch may draw random numbers on: the CPU, every parameter's, the step's and the batch's.

        A model spread over several devices in one process (``device_map="auto"``, manual model
        parallel) uses each of its parameters' devices; their set is found again only when the
        parameters change (their count, or the first one's device).
        """
        params = list(params) if params else list(self.sync.parameters())
        key = (len(params), None if not params else params[0].device, self.step.device)
        if key != self._devices_key:
            self._devices_key = key
            found = dict.fromkeys(p.device for p in params)
            self._devices = tuple(dict.fromkeys(d for d in (_CPU, *found, self.step.device) if d is not None))
        if batch is None:
            return self._devices
        return tuple(dict.fromkeys((*self._devices, *batch_devices(batch))))

    def _explained(
        self, final: ElasticOOMError, call: _Call, size: int, error: BaseException | None
    ) -> ElasticOOMError:
        """The error at the limit, with what the probe saw: in use before the step, and what the microbatch needed.

        Only where this rank ran out itself: a rank stopped by a peer's OOM says nothing of its own memory.
        """
        if call.before is None or error is None or not is_oom_error(error) or isinstance(error, PeerFailure):
            return final
        shortfall = Shortfall(type(call.watch).__name__, call.before, call.held, requested_bytes(error))
        return ElasticOOMError(f"{final}. {shortfall.note(size, self.controller.unit)}")

    def _watching(self, probe: MemoryProbe | None) -> MemoryProbe | None:
        """What the error at the limit reads: the step's probe, else the innermost active one (a ``MemoryBudget``)."""
        if probe is not None:
            return probe
        if isinstance(self.step.memory, MemoryProbe):
            return self.step.memory
        if self._probe is not None:
            return self._probe
        return next((m for m in reversed(_get_current_dispatch_mode_stack()) if isinstance(m, MemoryProbe)), None)

    def _model(self, probe: MemoryProbe | None) -> MemoryModel | None:
        return self.controller.memory if probe is not None else None

    def _memory_probe(self, batch: ElasticBatch) -> MemoryProbe | None:
        """The probe ``backward`` measures with, or ``None`` (no probe, or the controller predicts nothing).

        With ``memory="auto"``: the probe of the accelerators the parameters, the step and the
        batch use (found once; several devices: a :class:`DevicesProbe`), else the :class:`MemoryProbe`
        active as a dispatch mode around this call (``with MemoryBudget(...):``), else none.
        """
        model = self.controller.memory
        memory = self.step.memory
        if model is None or not model.enabled or memory is None:
            return None
        if isinstance(memory, MemoryProbe):
            return memory
        if self._device is None:
            devices = [d for d in self.devices(None, batch) if d.type != "cpu"]
            self._device = ", ".join(str(d) for d in devices) or "cpu"
            self._probe = devices_probe(devices)
        probe = self._probe if self._probe is not None else active_probe()
        model.unprobed = None if probe is not None else self._device
        return probe

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

    def _forecast(self, meter: Meter | None, error: BaseException | None) -> int:
        """After an attempt, before the vote: what the model learned from it, and its prediction for the next."""
        if meter is None:
            return 0
        try:
            if error is not None and is_oom_error(error) and not isinstance(error, PeerFailure):
                meter.failed()  # a peer's failure at an FSDP2 collective says nothing of this rank's memory
            return self.controller.forecast(meter.reading())
        except Exception:  # a probe that fails must not keep this rank from the vote: predict nothing
            return 0

    def _say_once(self, key: str, message: str) -> None:
        """Warn ``message`` once per step object (on rank zero), for one kind of fall-back to the search."""
        if key not in self._said:
            self._said.add(key)
            warn_on_rank_zero(f"elastic_batches: ElasticStep: {message}", stacklevel=6)

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
        if source is not None and source is not self.controller.settled.source:
            warn_once(
                "elastic_batches: ElasticStep got a batch tagged by another SplitController than its own: what the "
                "step learns (the split count) never reaches the loader, nor its state_dict, so a resumed run runs "
                "out of memory its way down again. Share the loader's: "
                "ElasticStep(model, controller=loader.controller)",
                stacklevel=5,
            )

    def _stop_together(self, final: ElasticOOMError | None, oom: BaseException | None) -> None:
        """After an OOM, every rank learns whether any rank reached its smallest microbatch; then all raise or none.

        Ranks with different batches may reach a limit (``max_split_count``, ``min_microbatch_size``
        in tokens) at different times; this small collective runs only after an OOM, never in a
        step that fitted. Where the scheme can switch to one that holds less memory (FSDP2
        ``gather="auto"``), every rank does instead of raising, and the controller forgets the sizes
        that failed under the old one.
        """
        outcome = self.sync.agree(Status.OOM if final is not None else Status.OK)
        if (final is not None or outcome.status != Status.OK) and self.sync.fall_back():
            self.controller.forget_sizes()
            return
        if final is not None:
            raise final from oom
        if outcome.status != Status.OK:
            raise ElasticOOMError(
                f"rank(s) {list(outcome.oom_ranks)} ran out of memory even at their smallest microbatch; this rank "
                "stops too instead of waiting for them (see their error for what was tried)"
            ) from oom


def _read(probe: MemoryProbe | None) -> MemoryReading | None:
    """``probe``'s reading, or ``None`` (no probe, or it raised: a message must not fail for it)."""
    if probe is None:
        return None
    try:
        return probe.memory_reading()
    except Exception:
        return None


def raise_if_failed(outcome: Verdict, error: BaseException | None, where: str) -> None:
    """Raise on every rank when a phase that splitting cannot help failed on any rank (the optimizer step).

    Args:
        outcome: The verdict of the phase's vote.
        error: This rank's own error in the phase, or ``None``.
        where: What the message names (``"optimizer.step()"``).
    """
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

"""``ElasticAccumulation``: the callback that gives any Lightning ``Trainer`` automatic microbatching."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import BatchSizeFinder
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from elastic_batches._state import check_state_dict, is_int
from elastic_batches.batch import ElasticBatch
from elastic_batches.controller import SplitController
from elastic_batches.distributed import GATHER_MODES
from elastic_batches.lightning._evaluation import elastic_evaluation_hook
from elastic_batches.lightning._progress import SplitPostfix
from elastic_batches.lightning._stages import STAGE_OF_HOOK, STAGES, Stages
from elastic_batches.lightning._training import ElasticOptimization
from elastic_batches.lightning.module import ElasticModule
from elastic_batches.memory import MemoryProbe, check_memory
from elastic_batches.step import ElasticStep

__all__ = ["STAGES", "ElasticAccumulation", "check_no_batch_size_finder"]

_STATE_VERSION = 1
_STATE_KEYS = frozenset({"version", "controllers"})


def _callbacks_of(trainer: Trainer) -> list[Callback]:
    return list(getattr(trainer, "callbacks", []))


def check_no_batch_size_finder(callbacks: Sequence[Callback]) -> None:
    """Refuse a ``BatchSizeFinder`` next to automatic splitting (it would search without ever hitting an OOM).

    Raises:
        ValueError: ``callbacks`` holds a ``BatchSizeFinder``.

    Example:
        >>> from lightning.pytorch.callbacks import BatchSizeFinder
        >>> from elastic_batches.lightning.callback import check_no_batch_size_finder
        >>> check_no_batch_size_finder([BatchSizeFinder()])
        Traceback (most recent call last):
        ...
        ValueError: BatchSizeFinder cannot be combined with accumulate_grad_batches='auto' ...
    """
    if any(isinstance(c, BatchSizeFinder) for c in callbacks):
        raise ValueError(
            "BatchSizeFinder cannot be combined with accumulate_grad_batches='auto' (ElasticAccumulation): the finder "
            "looks for the largest batch that does not run out of memory, and automatic splitting makes every batch "
            "fit, so its search would only stop at max_val. Choose one: keep your batch size and let "
            "ElasticAccumulation split it, or remove ElasticAccumulation and let BatchSizeFinder change the batch size"
        )


class ElasticAccumulation(Callback):
    """Split every batch into as many microbatches as fit in memory, with the full-batch update.

    Add it to any ``lightning.pytorch.Trainer`` (``elastic_batches.lightning.Trainer`` adds it
    for ``accumulate_grad_batches="auto"``). On ``setup`` it puts
    :class:`elastic_batches.ElasticStep` under Lightning's automatic optimization closure and
    under the strategy's validation, test and predict steps; everything else — optimizer step,
    gradient clipping, precision plugin, lr schedulers, logging, checkpointing — stays
    Lightning's. ``teardown`` takes it out again.

    Each stage (``"train"``, ``"validate"``, ``"test"``, ``"predict"``) has its own
    :class:`elastic_batches.SplitController`; their state is part of the checkpoint, so a
    resumed run starts at the split count it had learned.

    Args:
        accumulate_grad_batches: Lightning's outer accumulation on top of the automatic split:
            one optimizer step every this many batches (each batch split as it needs). ``None``
            (default): the Trainer's own ``accumulate_grad_batches`` is kept.
        controllers: The controller of some stages, by stage name (to share one with a
            ``MicrobatchingDataLoader``, or to set ``min_microbatch_size``, ``grow_after``...).
            Other stages get a new ``SplitController()``.
        split_evaluation: ``False`` leaves validation, test and predict batches whole.
        gather: FSDP2 (``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``):
            ``"auto"`` (default), ``"attempt"`` or ``"module"``, as for
            :class:`elastic_batches.ElasticStep`; ignored by other strategies.
        memory: What the training steps measure memory with, for the controllers' memory model
            (``SplitController(margin=...)``): ``"auto"`` (default) the device's probe (CUDA,
            XPU; none on a CPU), a :class:`elastic_batches.memory.MemoryProbe` (an
            ``elastic_batches.testing.MemoryBudget`` on a CPU), or ``None`` (the OOM-driven search
            alone), as for :class:`elastic_batches.ElasticStep`.
        log_metrics: ``True`` logs ``elastic/split_count`` (in the progress bar's metrics too),
            ``elastic/microbatch_size`` and ``elastic/oom_retries`` with ``self.log`` on the Trainer's
            logging steps: they then reach ``callback_metrics``, ``logged_metrics`` and the loggers.
            ``False`` (default) adds nothing to the user's metrics: the split count is shown in the
            training progress bar's text (``split=2``) and in a console line on each change.

    Attributes:
        controllers: The controller of each stage.

    Raises:
        ValueError: ``controllers`` names an unknown stage, ``accumulate_grad_batches`` < 1, or
            ``gather`` is not one of ``"auto"``, ``"attempt"``, ``"module"``.
        TypeError: ``memory`` is not ``"auto"``, ``None`` or a ``MemoryProbe``.

    Example:
        >>> import lightning.pytorch as pl
        >>> import elastic_batches as eb
        >>> from elastic_batches.lightning import ElasticAccumulation
        >>> elastic = ElasticAccumulation(controllers={"train": eb.SplitController(split_count=2)})
        >>> trainer = pl.Trainer(callbacks=[elastic], logger=False, enable_checkpointing=False,
        ...                      enable_progress_bar=False, enable_model_summary=False)
        >>> elastic.controllers["train"].split_count, elastic.controllers["validate"].split_count
        (2, 1)
    """

    def __init__(
        self,
        accumulate_grad_batches: int | None = None,
        *,
        controllers: Mapping[str, SplitController] | None = None,
        split_evaluation: bool = True,
        gather: str = "auto",
        memory: MemoryProbe | str | None = "auto",
        log_metrics: bool = False,
    ) -> None:
        check_memory("ElasticAccumulation", memory)
        if gather not in GATHER_MODES:
            raise ValueError(f"ElasticAccumulation: gather must be one of {list(GATHER_MODES)}, got {gather!r}")
        if accumulate_grad_batches is not None and (not is_int(accumulate_grad_batches) or accumulate_grad_batches < 1):
            raise ValueError(
                "ElasticAccumulation: accumulate_grad_batches must be an int >= 1 or None, "
                f"got {accumulate_grad_batches!r}"
            )
        unknown = sorted(set(controllers or {}) - set(STAGES))
        if unknown:
            raise ValueError(f"ElasticAccumulation: unknown stage(s) {unknown} in controllers; use {list(STAGES)}")
        for stage, controller in (controllers or {}).items():
            if not isinstance(controller, SplitController):
                raise TypeError(
                    f"ElasticAccumulation: controllers[{stage!r}] must be an elastic_batches.SplitController, "
                    f"got {controller!r}"
                )
        self.accumulate_grad_batches = accumulate_grad_batches
        self.split_evaluation = split_evaluation
        self.gather = gather
        self.log_metrics = log_metrics
        self._postfix = SplitPostfix()
        self.elastic_stages = Stages(
            {stage: (controllers or {}).get(stage) or SplitController() for stage in STAGES},
            gather=gather,
            memory=memory,
        )  # what the installed steps, ElasticModule and ElasticDataModule share
        self.controllers: dict[str, SplitController] = self.elastic_stages.controllers
        self._last_counts = dict.fromkeys(STAGES, 1)  # the count the last line reported
        self._last_capacity: dict[str, int | None] = dict.fromkeys(STAGES)
        self._train_metrics: dict[str, float] | None = None
        self._installed: tuple[Trainer, ElasticOptimization] | None = None

    @staticmethod
    def find(trainer: Trainer | None) -> ElasticAccumulation | None:
        """The ``ElasticAccumulation`` among ``trainer``'s callbacks, or ``None``.

        Example:
            >>> import lightning.pytorch as pl
            >>> from elastic_batches.lightning import ElasticAccumulation
            >>> ElasticAccumulation.find(pl.Trainer(logger=False, enable_checkpointing=False)) is None
            True
        """
        if trainer is None:
            return None
        for callback in _callbacks_of(trainer):
            if isinstance(callback, ElasticAccumulation):
                return callback
        return None

    # -- installation -------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Check the configuration and put the elastic steps in place."""
        mine = [c for c in _callbacks_of(trainer) if isinstance(c, ElasticAccumulation)]
        if len(mine) > 1:
            raise ValueError(
                f"Trainer has {len(mine)} ElasticAccumulation callbacks: keep one (with "
                "elastic_batches.lightning.Trainer(accumulate_grad_batches='auto'), the one in callbacks= is used)"
            )
        check_no_batch_size_finder(_callbacks_of(trainer))
        if trainer.strategy.handles_gradient_accumulation:
            raise ValueError(
                f"ElasticAccumulation does not support {type(trainer.strategy).__name__}, which runs gradient "
                "accumulation itself (DeepSpeed): use its own micro-batch settings, or a DDP/single-device strategy"
            )
        if isinstance(trainer.strategy, FSDPStrategy):
            raise ValueError(
                "ElasticAccumulation does not support FSDPStrategy (FSDP1: FullyShardedDataParallel reduces gradients "
                "inside every backward, where an OOM on one rank would leave the others waiting). Shard with FSDP2: "
                "strategy=ModelParallelStrategy() and torch.distributed.fsdp.fully_shard in configure_model "
                "(also on the LightningModule itself)"
            )
        if stage == "fit" and not pl_module.automatic_optimization and not isinstance(pl_module, ElasticModule):
            self.elastic_stages.unsplit.manual_optimization(type(pl_module).__name__)
        if self.accumulate_grad_batches is not None:
            trainer.accumulate_grad_batches = self.accumulate_grad_batches
        self._install(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Take the elastic steps out again: the Trainer is as it was before ``setup``."""
        self._uninstall()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """A run that raised ends without ``teardown``: take the elastic steps out all the same."""
        self.teardown(trainer, pl_module, "")

    def _install(self, trainer: Trainer) -> None:
        if self._installed is not None and self._installed[0] is trainer:
            return
        self._uninstall()
        stages, strategy = self.elastic_stages, trainer.strategy
        stages.attach(strategy, self._report)
        optimization = ElasticOptimization(trainer, stages, trainer.fit_loop.epoch_loop.automatic_optimization)
        optimization.install()
        precision = strategy.precision_plugin
        precision.__dict__["clip_grad_by_norm"] = optimization.agreed_clip_grad_by_norm(precision.clip_grad_by_norm)
        if self.split_evaluation:
            for hook in STAGE_OF_HOOK:
                strategy.__dict__[hook] = elastic_evaluation_hook(trainer, stages, hook, getattr(strategy, hook))
        self._installed = (trainer, optimization)

    def _uninstall(self) -> None:
        self.elastic_stages.detach()
        if self._installed is None:
            return
        trainer, optimization = self._installed
        optimization.uninstall()
        trainer.strategy.precision_plugin.__dict__.pop("clip_grad_by_norm", None)
        for hook in STAGE_OF_HOOK:
            trainer.strategy.__dict__.pop(hook, None)
        self._installed = None

    # -- what the steps use -------------------------------------------------------------------

    def step_for(self, stage: str, *, backward_fn: Callable[[torch.Tensor], Any] | None = None) -> ElasticStep:
        """The :class:`ElasticStep` of ``stage`` for the strategy's current model (DDP-wrapped or not).

        Raises:
            RuntimeError: the callback is not installed (outside a run).
        """
        return self.elastic_stages.step(stage, backward_fn=backward_fn)

    def _report(self, stage: str, count: int, size: int) -> None:
        """A batch of ``stage`` ran as ``count`` microbatches of at most ``size`` rows: metrics and a change's line."""
        controller = self.controllers[stage]
        if stage == "train" and self._installed is not None:
            self._postfix.show(self._installed[0], count)
        if stage == "train" and self.log_metrics:
            self._train_metrics = {
                "elastic/split_count": float(count),
                "elastic/microbatch_size": float(size),
                "elastic/oom_retries": float(controller.retry_count),
            }
        # A line when what the controller keeps to changes, not for a shorter last batch that needs fewer pieces.
        capacity = controller.microbatch_size
        before, known = self._last_counts[stage], self._last_capacity[stage]
        self._last_capacity[stage] = capacity
        if capacity == known or count == before:
            return
        self._last_counts[stage] = count
        # Lightning's own rank-zero messages reach the console without any logging set up: so does this one.
        rank_zero_info(
            f"elastic_batches: {stage} split count {before} -> {count} (largest microbatch {size} rows; "
            f"{self._limit(controller)}; "
            f"{controller.retry_count} OOM retries so far)"
        )

    @staticmethod
    def _limit(controller: SplitController) -> str:
        capacity = controller.microbatch_size
        unit = "rows" if controller.unit == "rows" else "tokens"
        return "no OOM yet" if capacity is None else f"microbatches of at most {capacity} {unit} fit"

    # -- Lightning hooks ----------------------------------------------------------------------

    @staticmethod
    def _batch_size_of(trainer: Trainer, batch: Any) -> None:
        # Lightning infers the batch size for self.log from the batch; an ElasticBatch (from a
        # MicrobatchingDataLoader) is not a structure it can read, so the size is given here.
        if isinstance(batch, ElasticBatch) and trainer._results is not None:
            trainer._results.batch_size = len(batch)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_size_of(trainer, batch)
        self._train_metrics = None

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._batch_size_of(trainer, batch)

    def on_test_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._batch_size_of(trainer, batch)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """``log_metrics=True``: log ``elastic/split_count``, ``elastic/microbatch_size``, ``elastic/oom_retries``.

        Only on the steps whose metrics the Trainer sends to its loggers (``log_every_n_steps``):
        a ``self.log`` call is not free, and values nobody sees are not worth it.
        """
        if not self.log_metrics or self._train_metrics is None or trainer._results is None:
            return
        if not trainer._logger_connector.should_update_logs:
            return
        for name, value in self._train_metrics.items():  # the split count in the progress bar's metrics too
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1, prog_bar=name.endswith("count"))

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The controllers' state, by stage (saved in Lightning checkpoints)."""
        return {"version": _STATE_VERSION, "controllers": {s: c.state_dict() for s, c in self.controllers.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the controllers from :meth:`state_dict` (on ``trainer.fit(..., ckpt_path=...)``).

        Every stage's state is checked before any is applied.

        Raises:
            ValueError: keys are missing or unexpected, the version is unknown, stages are
                missing or unknown (both are named), or a stage's controller state is refused
                (its message names the field); the controllers are then unchanged.
        """
        check_state_dict("ElasticAccumulation", state_dict, _STATE_KEYS, _STATE_VERSION)
        states = state_dict["controllers"]
        missing, unknown = sorted(set(STAGES) - set(states)), sorted(set(states) - set(STAGES))
        if missing or unknown:
            raise ValueError(
                f"ElasticAccumulation.load_state_dict: stages missing {missing}, unknown {unknown} in "
                f"state['controllers']; a state_dict() has one controller state for each of {list(STAGES)}"
            )
        for stage in STAGES:  # a trial load of each, into a copy: a bad one is refused before any is applied
            trial = SplitController(unit=self.controllers[stage].unit)
            try:
                trial.load_state_dict(states[stage])
            except ValueError as err:
                raise ValueError(f"ElasticAccumulation.load_state_dict: the {stage!r} stage: {err}") from err
        for stage in STAGES:
            controller = self.controllers[stage]
            controller.load_state_dict(states[stage])
            self._last_counts[stage], self._last_capacity[stage] = controller.split_count, controller.microbatch_size
            if controller.split_count > 1 or controller.microbatch_size is not None:
                rank_zero_info(
                    f"elastic_batches: {stage} split count {controller.split_count}, restored from the "
                    f"checkpoint ({self._limit(controller)}; {controller.retry_count} OOM retries before it)"
                )

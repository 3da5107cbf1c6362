"""``ElasticAccumulation``: the callback that gives any Lightning ``Trainer`` automatic microbatching."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import BatchSizeFinder
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden

from elastic_batches._state import check_state_dict
from elastic_batches.batch import ElasticBatch
from elastic_batches.controller import SplitController
from elastic_batches.distributed import GATHER_MODES
from elastic_batches.lightning._evaluation import STAGE_OF_HOOK, elastic_evaluation_hook
from elastic_batches.lightning._logging import LogRecorder
from elastic_batches.lightning._training import ElasticOptimization
from elastic_batches.lightning.module import ElasticModule
from elastic_batches.step import ElasticStep

__all__ = ["STAGES", "ElasticAccumulation", "check_no_batch_size_finder"]

logger = logging.getLogger(__name__)

STAGES = ("train", "validate", "test", "predict")
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

    Attributes:
        controllers: The controller of each stage.

    Raises:
        ValueError: ``controllers`` names an unknown stage, ``accumulate_grad_batches`` < 1, or
            ``gather`` is not one of ``"auto"``, ``"attempt"``, ``"module"``.

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
    ) -> None:
        if gather not in GATHER_MODES:
            raise ValueError(f"ElasticAccumulation: gather must be one of {list(GATHER_MODES)}, got {gather!r}")
        if accumulate_grad_batches is not None and (
            isinstance(accumulate_grad_batches, bool)
            or not isinstance(accumulate_grad_batches, int)
            or accumulate_grad_batches < 1
        ):
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
        self.controllers: dict[str, SplitController] = {
            stage: (controllers or {}).get(stage) or SplitController() for stage in STAGES
        }
        self._steps: dict[str, ElasticStep] = {}
        self._recorder: LogRecorder | None = None
        self._last_counts = dict.fromkeys(STAGES, 1)
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
        if not pl_module.automatic_optimization and not isinstance(pl_module, ElasticModule):
            raise ValueError(
                f"{type(pl_module).__name__} uses manual optimization: ElasticAccumulation cannot split a "
                "training_step that steps the optimizer itself. Mix in elastic_batches.lightning.ElasticModule and "
                "call self.elastic_backward(batch, loss_fn) in training_step instead of self.manual_backward(loss)"
            )
        if self.accumulate_grad_batches is not None:
            trainer.accumulate_grad_batches = self.accumulate_grad_batches
        self._install(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Take the elastic steps out again: the Trainer is as it was before ``setup``."""
        self._uninstall()
        self._steps.clear()
        self._recorder = None

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """A run that raised ends without ``teardown``: take the elastic steps out all the same."""
        self.teardown(trainer, pl_module, "")

    def _install(self, trainer: Trainer) -> None:
        if self._installed is not None and self._installed[0] is trainer:
            return
        self._uninstall()
        optimization = ElasticOptimization(trainer, self, trainer.fit_loop.epoch_loop.automatic_optimization)
        optimization.install()
        strategy = trainer.strategy
        precision = strategy.precision_plugin
        precision.__dict__["clip_grad_by_norm"] = optimization.agreed_clip_grad_by_norm(precision.clip_grad_by_norm)
        if self.split_evaluation:
            for hook in STAGE_OF_HOOK:
                strategy.__dict__[hook] = elastic_evaluation_hook(trainer, self, hook, getattr(strategy, hook))
        self._installed = (trainer, optimization)

    def _uninstall(self) -> None:
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
        """The :class:`ElasticStep` of ``stage`` for the strategy's current model (DDP-wrapped or not)."""
        assert self._installed is not None, "ElasticAccumulation.step_for is called by the installed steps only"
        model = self._installed[0].strategy.model
        assert model is not None, "the strategy has no model yet"
        step = self._steps.get(stage)
        if step is None or step.model is not model:
            step = self._steps[stage] = ElasticStep(model, controller=self.controllers[stage], gather=self.gather)
        step.controller = self.controllers[stage]
        step.backward_fn = backward_fn
        return step

    def recorder_for(self, module: LightningModule) -> LogRecorder:
        """The recorder of ``module``'s ``self.log`` calls (one per module)."""
        if self._recorder is None or self._recorder.module is not module:
            self._recorder = LogRecorder(module)
        return self._recorder

    @staticmethod
    def count_fn(module: LightningModule) -> Callable[[Any], Any] | None:
        """``module.elastic_count`` when an :class:`ElasticModule` defines it, else ``None`` (weights by rows)."""
        if isinstance(module, ElasticModule) and is_overridden("elastic_count", module, ElasticModule):
            return module.elastic_count
        return None

    @staticmethod
    def microbatch_hooks(module: LightningModule) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
        """An :class:`ElasticModule`'s per-microbatch hooks (start, end), else ``None``."""
        if isinstance(module, ElasticModule):
            return module.on_train_microbatch_start, module.on_train_microbatch_end
        return None

    def after_train_batch(
        self, trainer: Trainer, module: LightningModule, count: int, size: int, step: ElasticStep
    ) -> None:
        """Note what the batch used (logged in ``on_train_batch_end``).

        Args:
            trainer: The trainer.
            module: The LightningModule.
            count: Microbatches the batch ran as.
            size: Rows of its largest microbatch.
            step: The step that ran it.
        """
        controller = step.controller
        self._train_metrics = {
            "elastic/split_count": float(count),
            "elastic/microbatch_size": float(size),
            "elastic/oom_retries": float(controller.retry_count),
        }
        self._note_change(trainer, "train", count, controller)

    def after_evaluation_batch(self, trainer: Trainer, stage: str, count: int) -> None:
        """Note the count an evaluation batch used (an INFO line when it changes)."""
        self._note_change(trainer, stage, count, self.controllers[stage])

    def _note_change(self, trainer: Trainer, stage: str, count: int, controller: SplitController) -> None:
        before = self._last_counts[stage]
        if count == before:
            return
        self._last_counts[stage] = count
        if trainer.is_global_zero:
            logger.info(
                "elastic_batches: %s split count %d -> %d "
                "(largest microbatch that fits: %s rows; %d OOM retries so far)",
                stage,
                before,
                count,
                controller.microbatch_size,
                controller.retry_count,
            )

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
        """Log ``elastic/split_count``, ``elastic/microbatch_size`` and ``elastic/oom_retries`` for the step.

        Only on the steps whose metrics the Trainer sends to its loggers (``log_every_n_steps``):
        ``self.log`` costs about a millisecond a call, too much to spend on values nobody sees.
        """
        if self._train_metrics is None or trainer._results is None:
            return
        if not trainer._logger_connector.should_update_logs:
            return
        for name, value in self._train_metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The controllers' state, by stage (saved in Lightning checkpoints)."""
        return {"version": _STATE_VERSION, "controllers": {s: c.state_dict() for s, c in self.controllers.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the controllers from :meth:`state_dict` (on ``trainer.fit(..., ckpt_path=...)``).

        Raises:
            ValueError: keys are missing or unexpected, or the version is unknown.
        """
        check_state_dict("ElasticAccumulation", state_dict, _STATE_KEYS, _STATE_VERSION)
        for stage, state in state_dict["controllers"].items():
            if stage in self.controllers:
                self.controllers[stage].load_state_dict(state)

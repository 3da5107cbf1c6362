"""The split count in the training progress bar's text, first, without joining the user's metrics.

Lightning's progress bars show ``get_metrics()`` (the ``v_num`` and every ``prog_bar=True``
metric) as the bar's postfix. The split count is not a metric of the user's: it is put in front
of that text where the bar draws it (``Tqdm.set_postfix`` of the TQDM bar, the Rich bar's metrics
column), so ``trainer.progress_bar_metrics``, ``get_metrics()`` and a subclass overriding it see
exactly what they see without ``"auto"``. It reads ``split=2`` and is updated on every step the
bar is refreshed. Another progress bar class is left alone.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

__all__ = ["KEY", "SplitPostfix"]

KEY = "split"  # short: a bar at 80 columns cuts a long key


class SplitPostfix:
    """Puts ``split=<count>`` first in the postfix of the trainer's training progress bar.

    Example:
        >>> from tqdm import tqdm
        >>> from elastic_batches.lightning._progress import SplitPostfix
        >>> bar = tqdm(total=4, disable=True)
        >>> postfix = SplitPostfix()
        >>> postfix.wrap_tqdm(bar)
        >>> postfix.count = 2
        >>> bar.set_postfix({"loss": "0.5"})
        >>> bar.postfix
        'split=2, loss=0.5'
    """

    def __init__(self) -> None:
        self.count: int | None = None  # the last training batch's microbatches; None: none ran yet

    def show(self, trainer: Any, count: int) -> None:
        """A training batch ran as ``count`` microbatches: show it from the next refresh of the bar on."""
        self.count = count
        bar = getattr(trainer, "progress_bar_callback", None)
        tqdm = getattr(bar, "_train_progress_bar", None)
        if tqdm is not None and hasattr(tqdm, "set_postfix"):
            self.wrap_tqdm(tqdm)
        column = getattr(bar, "_metric_component", None)
        if column is not None and hasattr(column, "update"):
            self.wrap_rich(column)

    def _ahead(self, metrics: Any) -> Any:
        if self.count is None:
            return metrics
        return OrderedDict([(KEY, str(self.count)), *dict(metrics or {}).items()])

    def wrap_tqdm(self, bar: Any) -> None:
        """Let ``bar.set_postfix`` put the split count first (once per bar)."""
        if not isinstance(bar.__dict__.get("set_postfix"), _LeadingSplit):
            bar.__dict__["set_postfix"] = _LeadingSplit(self, bar, "set_postfix")

    def wrap_rich(self, column: Any) -> None:
        """Let the Rich bar's metrics column put the split count first (once per column)."""
        if not isinstance(column.__dict__.get("update"), _LeadingSplit):
            column.__dict__["update"] = _LeadingSplit(self, column, "update")


class _LeadingSplit:
    """``target.<method>(metrics, ...)`` of the target's class, with the split count first in ``metrics``.

    An object, not a closure: the progress bar (and the trainer holding it) stays picklable.
    """

    def __init__(self, postfix: SplitPostfix, target: Any, method: str) -> None:
        self.postfix, self.target, self.method = postfix, target, method

    def __call__(self, metrics: Any = None, *args: Any, **kwargs: Any) -> Any:
        ahead = self.postfix._ahead(metrics)
        if self.method == "update":  # the Rich column keeps a plain dict
            ahead = dict(ahead)
        return getattr(type(self.target), self.method)(self.target, ahead, *args, **kwargs)

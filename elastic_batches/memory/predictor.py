"""``Predictor``: what a :class:`~elastic_batches.SplitController` plans from measured memory.

The controller holds one (with a ``margin``) and feeds it what each vote of the ranks says; the
step feeds its :class:`~elastic_batches.memory.MemoryModel` through a meter. It answers one
question in two forms: the largest microbatch predicted to fit (a size, which every rank votes),
and whether a batch must be measured before it can be planned.
"""

from __future__ import annotations

from elastic_batches.memory.model import MemoryModel
from elastic_batches.memory.probe import MemoryReading

__all__ = ["Predictor"]


class Predictor:
    """The memory model, and the size the ranks' models agreed fits at the last vote.

    Args:
        model: The model the step's meter feeds.

    Attributes:
        model: The :class:`MemoryModel`.
        agreed: The largest microbatch the ranks' models predicted fits at the last vote (the
            smallest over ranks), ``None`` where some rank predicted nothing.
        fallback: An OOM happened since the last success: the search plans the retry too (the more
            cautious of the two).
        voted: A vote told what the ranks predict (a rank that predicts nothing stops prediction
            on every rank until all do).

    Example:
        >>> from elastic_batches.memory import MemoryModel, MemoryReading, Predictor
        >>> predictor = Predictor(MemoryModel())
        >>> predictor.limit(MemoryReading(in_use=0, capacity=1 << 30)) is None  # nothing measured yet
        True
    """

    def __init__(self, model: MemoryModel) -> None:
        self.model = model
        self.agreed: int | None = None
        self.fallback = False
        self.voted = False

    @property
    def ready(self) -> bool:
        """Whether plans are predicted (the model is fitted, and enabled)."""
        return self.model.ready

    @property
    def measures(self) -> bool:
        """Whether a batch is measured before it is planned: the model is on, and cannot plan yet."""
        return self.model.enabled and not self.model.ready

    def limit(self, memory: MemoryReading | None) -> int | None:
        """The largest microbatch predicted to fit: agreed at the last vote, or less in ``memory`` now; ``None``."""
        if not self.model.ready:
            return None
        if self.voted and self.agreed is None:
            return None  # some rank predicts nothing at the last vote: every rank plans from the search alike
        sizes = [] if self.agreed is None else [self.agreed]
        if memory is not None and memory.capacity is not None:
            sizes.append(self.size(memory))
        return max(1, min(sizes)) if sizes else None

    def size(self, memory: MemoryReading, *, started: bool = False) -> int:
        """The largest microbatch the model predicts fits in ``memory`` with the margin, in the controller's unit.

        Until the model was wrong on this device once, the margin costs at most a twentieth of
        the size it predicts without one (``size - size // 20``, so none below 20 rows or tokens),
        which keeps any batch within ``max(fewest + 1, 1.1 * fewest)`` microbatches: rows are
        coarse (with pieces of 3 rows, one row less is a third more microbatches), and a device
        the model was never wrong on needs no more. After an OOM it did not predict, the whole
        (widened) margin applies. A size, not a count: every rank votes it, and any batch's count
        follows from it (0: nothing fits).
        """
        model = self.model
        size = model.largest(memory, started=started, cautious=started)
        if not model.wrong:
            exact = model.largest(memory, started=started, margin=0.0, cautious=started)
            size = max(size, exact - exact // 20)
        return size

    def forecast(self, memory: MemoryReading) -> int:
        """The largest microbatch predicted to fit an attempt starting with ``memory``; 0: no prediction."""
        if not self.model.ready or memory.capacity is None:
            return 0
        return max(1, self.size(memory))

    def trusted(self) -> int | None:
        """The agreed size where plans follow it (no OOM since the last success), else ``None``."""
        return self.agreed if self.agreed is not None and not self.fallback and self.model.ready else None

    def succeeded(self, capacity: int | None, *, calm: bool) -> None:
        """A batch completed; the vote said ``capacity`` fits (0 or ``None``: some rank predicts nothing).

        ``calm``: no OOM on the batch, so a margin widened by a spike narrows back in time.
        """
        if calm:
            self.model.calm_batch()
        self.agreed, self.fallback, self.voted = capacity or None, False, True

    def failed(self, capacity: int | None) -> None:
        """An attempt ran out of memory; the vote said ``capacity`` fits, refitted with that OOM."""
        self.agreed, self.voted = capacity or None, True
        self.fallback = self.model.ready  # the retry: the more cautious of the model's plan and the search's

    def note(self, unit: str) -> str:
        """What an INFO line adds while the model has measured something: its estimate."""
        if not self.model.ready:
            return ""
        predicted = "" if self.agreed is None else f"; it predicts microbatches of up to {self.agreed} {unit} fit"
        return f" (memory model: {self.model.describe()}{predicted})"

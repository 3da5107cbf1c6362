"""Several ranks and a module without a wrapper: the ranks agree on every outcome; gradients are the user's."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from elastic_batches.distributed.protocol import (
    VOTE_WIDTH,
    Ballot,
    GradientSync,
    Rows,
    Verdict,
    agreement_of,
    check_values,
    verdict_of,
)
from elastic_batches.distributed.wire import ALL_GATHER, HostWritten
from elastic_batches.oom import Status

__all__ = ["Agreeing"]


class Agreeing(GradientSync):
    """Several ranks: agree on the outcome; gradients are the user's business (a plain module)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(model)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if dist.get_backend(group) == dist.Backend.GLOO:
            self.device = torch.device("cpu")
        else:
            self.device = next(model.parameters()).device
        # Allocated once, so that a vote never allocates (an OOM in it would strand the peers).
        self._mine = HostWritten(VOTE_WIDTH, torch.float64, self.device)
        self._gathered = torch.zeros(self.world_size * VOTE_WIDTH, dtype=torch.float64, device=self.device)

    def _exchange(self, values: Sequence[float]) -> Rows:
        getattr(dist, ALL_GATHER)(self._gathered, self._mine.write(values), group=self.group)
        return tuple(map(tuple, self._gathered.view(self.world_size, VOTE_WIDTH).tolist()))

    def vote(self, ballot: Ballot, params: Sequence[torch.Tensor] | None = None) -> Verdict:
        return verdict_of(
            self._exchange((ballot.status, ballot.size, ballot.total, 0.0, ballot.capacity)), ballot.total
        )

    def agree(self, status: Status, *values: float) -> Verdict:
        check_values(values)
        return agreement_of(self._exchange((status, *values)), len(values))

    def reduce(self, params: Sequence[torch.Tensor], scale: float) -> None:
        pass

"""Lightning's ``zero_grad`` after the first ``training_step`` of a batch, before its backward.

Lightning's closure runs ``training_step``, then ``zero_grad`` (``on_before_zero_grad``,
``optimizer_zero_grad``), then ``backward``. A split batch keeps that order: the first
microbatch whose ``training_step`` returns triggers ``zero_grad``, later microbatches and retries
do not zero again. ``ElasticStep`` sets the gradients already in ``.grad`` aside when a step
starts and adds them back at its end (an outer accumulation); here that would keep the
gradients ``zero_grad`` is meant to clear, so they are set aside before the step instead, put
back just for ``zero_grad``, and whatever ``zero_grad`` leaves (nothing, with ``set_to_none``;
zeros, or a custom hook's choice otherwise) is set aside again and added back at the end. A retry
after an OOM then starts from what ``zero_grad`` left, and a batch whose first ``training_step``
raises is neither zeroed nor counted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["ZeroGradAfterFirstStep"]


class ZeroGradAfterFirstStep:
    """Calls ``zero_grad_fn`` once, after the first ``training_step`` of the batch, on the gradients it had.

    Args:
        parameters: The parameters ``zero_grad_fn`` may clear (the LightningModule's).
        zero_grad_fn: Lightning's ``zero_grad`` of the batch (its hooks and ``optimizer_zero_grad``).

    Example:
        >>> import torch
        >>> from elastic_batches.lightning._zero_grad import ZeroGradAfterFirstStep
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> p.grad = torch.full((2,), 5.0)  # the previous batch's
        >>> zero = ZeroGradAfterFirstStep([p], lambda: setattr(p, "grad", None))
        >>> p.grad is None  # set aside while the step starts
        True
        >>> zero()  # after the first training_step: zeroes what was there
        >>> (p * 3).sum().backward()
        >>> zero.finish()
        >>> p.grad
        tensor([3., 3.])
    """

    def __init__(self, parameters: list[torch.Tensor], zero_grad_fn: Callable[[], None]) -> None:
        self._parameters = parameters
        self._zero_grad_fn = zero_grad_fn
        self._aside = self._set_aside()
        self.done = False

    def _set_aside(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        aside = [(p, p.grad) for p in self._parameters if p.grad is not None]
        for p, _ in aside:
            p.grad = None
        return aside  # type: ignore[return-value]

    def __call__(self) -> None:
        """After a ``training_step``: zero the gradients the batch started with, the first time only."""
        if self.done:
            return
        self.done = True
        for p, grad in self._aside:
            p.grad = grad
        self._aside = []
        self._zero_grad_fn()
        self._aside = self._set_aside()

    def finish(self) -> None:
        """After the step, done or failed: add back what was set aside (before ``zero_grad``: the old gradients)."""
        for p, grad in self._aside:
            if p.grad is not None:
                grad.add_(p.grad)
            p.grad = grad
        self._aside = []

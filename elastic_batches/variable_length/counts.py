"""``label_count``: the ``count_fn`` of a loss that is a mean over non-ignored labels.

A token-mean loss accumulates exactly when each microbatch is weighted by the number of items
its loss is a mean over (``ElasticStep.backward(..., count_fn=...)``). Which items those are
depends on the model:

- A **causal LM** of Hugging Face (``GPT2LMHeadModel``, ``LlamaForCausalLM``... given
  ``labels``) shifts the labels inside the model: position ``t`` predicts ``labels[:, t + 1]``,
  so its loss is a mean over ``labels[:, 1:] != -100``. Counting ``labels != -100`` counts one
  token too many per row whose first label is not ignored: the weights are then wrong by a few
  percent (``docs/recipes.md`` shows it on a tiny GPT-2).
- A **masked LM** or a **token classifier** (``BertForMaskedLM``, ``...ForTokenClassification``)
  does not shift: the mean is over ``labels != -100``.
- A **sequence classifier** has one label per row: the loss is a mean over rows, the default
  weights are exact, and no ``count_fn`` is needed (``label_count(causal=False)`` counts the
  rows, which is the same).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["LabelCount", "label_count"]


@dataclasses.dataclass(frozen=True)
class LabelCount:
    """A ``count_fn`` that counts a microbatch's labels other than ``ignore_index`` (see :func:`label_count`).

    Attributes:
        causal: Count ``labels[:, 1:]``: the labels a causal LM's shifted loss is a mean over.
        key: The labels' field (a mapping key, or an attribute of the microbatch).
        ignore_index: The label value the loss ignores.
    """

    causal: bool
    key: str = "labels"
    ignore_index: int = -100

    def __call__(self, microbatch: Any) -> torch.Tensor:
        """The number of labels ``microbatch``'s loss is a mean over (a 0-d tensor).

        Raises:
            KeyError: the microbatch has no field :attr:`key`.
            ValueError: ``causal`` and the labels are not ``[rows, length, ...]``.
        """
        if isinstance(microbatch, Mapping):
            if self.key not in microbatch:
                raise KeyError(
                    f"label_count: the microbatch has no field {self.key!r} (its fields are {sorted(microbatch)}); "
                    "name the labels with label_count(key=...)"
                )
            labels = microbatch[self.key]
        elif hasattr(microbatch, self.key):
            labels = getattr(microbatch, self.key)
        else:
            raise KeyError(
                f"label_count: a microbatch of type {type(microbatch).__qualname__} has no {self.key!r}; name the "
                "labels with label_count(key=...)"
            )
        if self.causal:
            if labels.dim() < 2:
                raise ValueError(
                    f"label_count(causal=True): labels {self.key!r} of shape {tuple(labels.shape)} have no sequence "
                    "dimension to shift; a sequence classifier needs no count_fn (rows are the default weights)"
                )
            labels = labels[:, 1:]
        return (labels != self.ignore_index).sum()


def label_count(*, causal: bool, key: str = "labels", ignore_index: int = -100) -> LabelCount:
    """The ``count_fn`` for a loss that is a mean over the labels that are not ``ignore_index``.

    Pass it to :meth:`ElasticStep.backward` with a Hugging Face model's ``outputs.loss`` (or any
    loss with ``ignore_index``): the microbatches are weighted by their counts, so that the
    accumulated gradient is that of the mean over the whole batch's labels.

    Args:
        causal: ``True`` for a causal LM whose loss shifts the labels (Hugging Face's
            ``...ForCausalLM``, ``GPT2LMHeadModel``: position ``t`` predicts label ``t + 1``), so
            that ``labels[:, 1:]`` is counted; ``False`` for a loss over the labels as they are
            (masked LM, token classification, or labels you shifted yourself). Required: the
            two counts differ, and the wrong one is off by a few percent.
        key: The labels' field in the microbatch (default ``"labels"``).
        ignore_index: The label value the loss ignores (default ``-100``, Hugging Face's and
            ``torch.nn.functional.cross_entropy``'s).

    Returns:
        A :class:`LabelCount`: ``microbatch -> 0-d tensor``, picklable.

    Example:
        >>> import torch
        >>> import elastic_batches as eb
        >>> labels = torch.tensor([[5, 6, 7, -100], [8, -100, -100, -100]])
        >>> int(eb.label_count(causal=True)({"labels": labels})), int(eb.label_count(causal=False)({"labels": labels}))
        (2, 4)
    """
    if not isinstance(causal, bool):
        raise TypeError(f"label_count: causal must be True (a causal LM) or False (masked LM...), got {causal!r}")
    return LabelCount(causal=causal, key=key, ignore_index=ignore_index)

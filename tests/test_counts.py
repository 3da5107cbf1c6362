"""``label_count``: the exact ``count_fn`` for causal (shifted) and unshifted label means.

The reference is the loss the models compute: a causal LM's mean over ``labels[:, 1:]``
(position ``t`` predicts label ``t + 1``, as Hugging Face's ``ForCausalLMLoss`` does), an
unshifted mean over ``labels``. Hugging Face models are tested in ``tests/test_huggingface.py``.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import elastic_batches as eb

LABELS = torch.tensor([[5, 6, 7, -100], [-100, -100, 3, -100], [1, -100, -100, -100]])


@pytest.mark.parametrize(("causal", "expected"), [(True, 3), (False, 5)], ids=["causal", "unshifted"])
def test_counts_the_labels_the_loss_is_a_mean_over(causal: bool, expected: int) -> None:
    assert int(eb.label_count(causal=causal)({"labels": LABELS})) == expected


def test_reads_another_key_an_attribute_and_another_ignore_index() -> None:
    class Batch:
        targets = torch.tensor([[0, 1, 0]])

    assert int(eb.label_count(causal=False, key="targets", ignore_index=0)(Batch())) == 1
    assert int(eb.label_count(causal=True, key="y")({"y": torch.tensor([[4, 4, -100]])})) == 1


class _ShiftedLM(nn.Module):
    """A causal LM whose loss shifts the labels inside, as Hugging Face's do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 10)
        self.double()

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(ids).cumsum(1)))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(10, (12, 9), generator=generator)
    labels = ids.clone()
    for row, length in enumerate(torch.randint(2, 10, (12,), generator=generator).tolist()):
        labels[row, length:] = -100
    labels[::3, 0] = -100  # some rows start with an ignored label, as after a masked prompt
    return {"ids": ids, "labels": labels}


@pytest.mark.parametrize(("causal", "exact"), [(True, True), (False, False)], ids=["causal", "naive"])
def test_the_causal_count_is_exact_for_a_shifted_loss_and_the_naive_one_is_not(causal: bool, exact: bool) -> None:
    model, batch = _ShiftedLM(), _batch()

    def loss_fn(mb: dict[str, Any]) -> torch.Tensor:
        return model(mb["ids"], mb["labels"])

    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=4))
    step.backward(batch, loss_fn, count_fn=eb.label_count(causal=causal))
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    loss_fn(batch).backward()
    want = torch.cat([p.grad.flatten() for p in model.parameters()])
    error = float((got - want).norm() / want.norm())
    assert (error < 1e-10) if exact else (error > 1e-3)


def test_is_picklable_and_says_what_it_counts() -> None:
    count = pickle.loads(pickle.dumps(eb.label_count(causal=True, key="y")))
    assert count == eb.label_count(causal=True, key="y")
    assert repr(count) == "LabelCount(causal=True, key='y', ignore_index=-100)"


def test_causal_must_be_said() -> None:
    with pytest.raises(TypeError, match=r"causal must be True \(a causal LM\) or False \(masked LM\.\.\.\), got 1"):
        eb.label_count(causal=1)  # type: ignore[arg-type]


def test_a_missing_field_names_the_fields() -> None:
    with pytest.raises(KeyError, match=r"no field 'labels' \(its fields are \['ids'\]\); name the labels with"):
        eb.label_count(causal=False)({"ids": torch.zeros(2, 3)})


def test_a_missing_attribute_names_the_type() -> None:
    with pytest.raises(KeyError, match=r"a microbatch of type tuple has no 'labels'"):
        eb.label_count(causal=False)((torch.zeros(2),))


def test_causal_labels_without_a_sequence_dimension_are_refused() -> None:
    with pytest.raises(ValueError, match=r"labels 'labels' of shape \(4,\) have no sequence dimension"):
        eb.label_count(causal=True)({"labels": torch.zeros(4)})

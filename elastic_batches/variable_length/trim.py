"""``TrimPadding``: keep the collate function that pads, and trim each microbatch to its own longest row.

``pad_values`` on the loader pads the samples itself, so it replaces the user's collate function
for the padded fields. A user who pads with a collator of their own (Hugging Face's
``DataCollatorWithPadding``, or ``DataCollatorForLanguageModeling`` with its dynamic masking)
wraps it instead: the collator runs as it is, in the worker, on the whole batch; each row's length
is then read from the attention mask (or from the pad values), and each microbatch is later cut
to its own longest row, as with ``pad_values``.

Only right padding can be trimmed exactly: the real tokens of a right-padded row keep their
positions when trailing padding is cut away, and a masked (or causal) model never lets padding
change them. Left padding is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from elastic_batches.batch import ElasticBatch
from elastic_batches.structures import Fields, flatten
from elastic_batches.variable_length.padding import Padding, PadValue, check_pad_values
from elastic_batches.variable_length.shape_buckets import ShapeBuckets

__all__ = ["TrimPadding"]


def _present(tensor: torch.Tensor, pad: PadValue) -> torch.Tensor:
    """``[rows, length]``: whether each position of a ``[rows, length, ...]`` tensor holds anything but ``pad``."""
    present = tensor.ne(pad)
    return present if present.dim() == 2 else present.flatten(2).any(dim=2)


def _last_position(present: torch.Tensor) -> list[int]:
    """Per row of a ``[rows, length]`` boolean tensor: one past its last ``True`` (0 for none)."""
    positions = torch.arange(1, present.shape[1] + 1, device=present.device)
    return (present * positions).amax(dim=1).tolist() if present.shape[1] else [0] * present.shape[0]


class TrimPadding:
    """Your collate function, padding as it does; each microbatch is then cut to its own longest row.

    Give it as the DataLoader's ``collate_fn``, around the collator that pads (Hugging Face's
    ``DataCollatorWithPadding``, ``DataCollatorForLanguageModeling``, any function that returns a
    mapping of tensors padded on the right). Each batch is collated by ``collate_fn`` as the plain
    loader would (dynamic masking included), and comes back as an :class:`ElasticBatch` that
    knows each row's length: each microbatch's padded fields are cut to its own longest row, as
    with the loader's ``pad_values``. ``loss_fn`` receives what ``collate_fn`` returned (a
    ``BatchEncoding`` stays one), cut to the microbatch's rows and length.

    Args:
        collate_fn: The collate function that pads: ``samples -> mapping`` of fields whose padded
            ones are ``[rows, length, ...]`` tensors padded on the right.
        mask: The field whose non-zero positions are a row's tokens (``"attention_mask"``,
            default): a row's length is one past its last non-zero position. ``None``: read the
            lengths from ``pad_values`` instead.
        pad_values: Field -> the value ``collate_fn`` pads it with. Without ``mask``, a row's
            length is one past the last position where any of these fields holds something
            other than its pad value (a pad value that is also a real token, such as GPT-2's
            end-of-text used as padding, is cut away at the end of a row: use the mask then).
            Needed with ``shape_buckets`` for every trimmed field, whose new positions hold it.
        fields: The fields to trim. ``None`` (default): every tensor field of at least two
            dimensions whose second one is the batch's padded length (the mask's, or the
            ``pad_values`` fields'). Labels of a sequence classifier (``[rows]``) are not trimmed.
        sort_by_length: Sort each batch's rows longest first, so that microbatches hold rows of
            similar length (default ``True``). The batch's mean loss does not depend on the order.
        shape_buckets: Round microbatch shapes up for ``torch.compile`` (see :class:`ShapeBuckets`).

    Raises:
        TypeError: ``collate_fn`` is not callable, ``pad_values`` is not a mapping of numbers, or
            ``shape_buckets`` is not a :class:`ShapeBuckets`.
        ValueError: neither ``mask`` nor ``pad_values`` is given, or ``fields`` is empty.

    Example:
        >>> import torch
        >>> import elastic_batches as eb
        >>> def pad(samples):  # a collator of your own, padding on the right, with a mask
        ...     ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in samples], batch_first=True)
        ...     return {"input_ids": ids, "attention_mask": (ids != 0).long()}
        >>> batch = eb.TrimPadding(pad)([[5, 6], [7, 8, 9, 10], [11]])
        >>> [tuple(mb.unwrap()["input_ids"].shape) for mb in batch.microbatches(2)]  # longest row first
        [(2, 4), (1, 1)]
    """

    def __init__(
        self,
        collate_fn: Callable[[list[Any]], Any],
        *,
        mask: str | None = "attention_mask",
        pad_values: Mapping[str, PadValue] | None = None,
        fields: Sequence[str] | None = None,
        sort_by_length: bool = True,
        shape_buckets: ShapeBuckets | None = None,
    ) -> None:
        if not callable(collate_fn):
            raise TypeError(f"TrimPadding: collate_fn must be callable (the collator that pads), got {collate_fn!r}")
        checked = check_pad_values(pad_values)
        if mask is None and checked is None:
            raise ValueError(
                "TrimPadding: give mask= (the attention mask field, e.g. 'attention_mask') or pad_values= "
                "({'input_ids': pad token id, ...}) to read each row's length from"
            )
        if fields is not None and (isinstance(fields, str) or not fields):
            raise ValueError(f"TrimPadding: fields must be a non-empty sequence of field names, got {fields!r}")
        if shape_buckets is not None and not isinstance(shape_buckets, ShapeBuckets):
            raise TypeError(f"TrimPadding: shape_buckets must be a elastic_batches.ShapeBuckets, got {shape_buckets!r}")
        self.collate_fn = collate_fn
        self.mask = mask
        self.pad_values: dict[str, PadValue] = {str(k): v for k, v in (checked or {}).items()}
        self.fields = None if fields is None else tuple(fields)
        self.sort_by_length = bool(sort_by_length)
        self.shape_buckets = shape_buckets

    def __repr__(self) -> str:
        return (
            f"TrimPadding({self.collate_fn!r}, mask={self.mask!r}, pad_values={self.pad_values or None!r}, "
            f"fields={self.fields!r}, sort_by_length={self.sort_by_length!r}, shape_buckets={self.shape_buckets!r})"
        )

    def __call__(self, samples: list[Any]) -> ElasticBatch:
        """Collate ``samples`` with ``collate_fn``; the batch, with each row's length read.

        Raises:
            KeyError: the mask, a ``pad_values`` field or a named field is not in the batch.
            ValueError: a row is padded on the left, a field is not ``[rows, length, ...]``, or
                ``shape_buckets`` needs a pad value that ``pad_values`` does not give.
        """
        collated = self.collate_fn(samples)
        fields, spec, rows = flatten(collated)
        what = type(collated).__qualname__
        lengths = self._row_lengths(fields, what)
        trimmed = self._trimmed_fields(fields, what)
        if self.shape_buckets is not None:
            missing = [key for key in trimmed if key not in self.pad_values]
            if missing:
                raise ValueError(
                    f"TrimPadding: shape_buckets pads microbatches up with each field's pad value, but fields "
                    f"{missing} have none: add them to pad_values (e.g. attention_mask: 0, labels: -100)"
                )
        if self.sort_by_length and rows > 1:
            order = sorted(range(rows), key=lambda i: -lengths[i])
            if order != list(range(rows)):
                fields = _reordered(fields, order)
                lengths = [lengths[i] for i in order]
        padding = Padding(
            values={key: self.pad_values.get(key) for key in trimmed},
            lengths={key: tuple(lengths) for key in trimmed},
            buckets=self.shape_buckets,
        )
        return ElasticBatch.from_fields(fields, spec, padding=padding)

    def _tensor(self, fields: Fields, key: str, what: str, role: str) -> torch.Tensor:
        if key not in fields:
            raise KeyError(
                f"TrimPadding: the batch collate_fn returned ({what}) has no field {key!r} ({role}); its fields are "
                f"{sorted(fields)}"
            )
        value = fields[key]
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__qualname__
            raise ValueError(f"TrimPadding: field {key!r} ({role}) must be a [rows, length, ...] tensor, got {shape}")
        return value

    def _row_lengths(self, fields: Fields, what: str) -> list[int]:
        if self.mask is not None:
            present = _present(self._tensor(fields, self.mask, what, "the mask"), 0)
            lengths = _last_position(present)
            starts = present[:, 0].tolist() if present.shape[1] else []
            for row, (length, starts_with_token) in enumerate(zip(lengths, starts, strict=False)):
                if length and not starts_with_token:
                    raise ValueError(
                        f"TrimPadding: row {row} of {self.mask!r} starts with padding (left padding): trimming it "
                        "would move the row's tokens to other positions. Pad on the right "
                        "(tokenizer.padding_side = 'right'), or drop TrimPadding"
                    )
            return lengths
        per_field = []
        for key, value in self.pad_values.items():
            tensor = self._tensor(fields, key, what, "in pad_values")
            per_field.append(_last_position(_present(tensor, value)))
        return [max(row) for row in zip(*per_field, strict=True)]

    def _trimmed_fields(self, fields: Fields, what: str) -> tuple[str, ...]:
        if self.fields is not None:
            for key in self.fields:
                self._tensor(fields, key, what, "in fields")
            return self.fields
        reference = self.mask if self.mask is not None else next(iter(self.pad_values))
        length = fields[reference].shape[1]
        return tuple(
            key
            for key, value in fields.items()
            if type(value) is torch.Tensor and value.dim() >= 2 and value.shape[1] == length
        )


def _reordered(fields: Fields, order: list[int]) -> Fields:
    """Every field's rows in ``order`` (tensors, TensorDicts and tensorclasses indexed, lists picked)."""
    index = torch.tensor(order)
    reordered: Fields = {}
    for key, value in fields.items():
        if type(value) is list:
            reordered[key] = [value[i] for i in order]
        elif isinstance(value, torch.Tensor):
            reordered[key] = value.index_select(0, index.to(value.device))
        else:
            reordered[key] = value[index]
    return reordered

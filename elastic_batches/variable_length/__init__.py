"""Variable-length batches: what the loader pads, what each microbatch trims, and what a loss counts.

* :mod:`~elastic_batches.variable_length.padding`: the per-field pad values and per-microbatch padding
  (``pad_values=``), checked once.
* :mod:`~elastic_batches.variable_length.trim`: :class:`TrimPadding`, a collate wrapper that trims each
  microbatch of an already-padded batch (Hugging Face's collators) to its own longest row.
* :mod:`~elastic_batches.variable_length.counts`: :func:`label_count`, the items a loss is averaged
  over, for ``count_fn``.
* :mod:`~elastic_batches.variable_length.tokens`: the ``tokens`` unit's arithmetic behind
  :class:`~elastic_batches.BatchLoad` (pieces of bounded padded positions).
* :mod:`~elastic_batches.variable_length.shape_buckets`: :class:`ShapeBuckets`, shapes rounded into a few
  buckets for ``torch.compile``.

The public names are exported from :mod:`elastic_batches`; ``docs/variable_length.md`` walks through them.
"""

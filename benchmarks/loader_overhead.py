"""Loader overhead: iterating ``MicrobatchingDataLoader`` vs the plain ``DataLoader`` it wraps.

Both loaders read the same dataset with the same arguments; the elastic one additionally wraps
each collated batch in an ``ElasticBatch`` and tags it with the split count in the main process.
The batch is taken apart into row-splittable fields at the step's first cut (a batch run whole
never is). The ``elastic, taken apart`` column iterates the elastic loader and takes every batch
apart in the loop, the cost a run pays when every batch is split. Two realistic per-sample datasets:

* ``text``: a dict per sample (``input_ids`` and ``attention_mask`` of 128 tokens cut from a
  token stream at a random offset, an int label), as a tokenised-text dataset returns;
* ``image``: a ``(3, 32, 32)`` float image decoded from uint8, normalised and randomly flipped, and
  an int label, as a torchvision-style dataset returns.

Each configuration runs full epochs of both loaders, alternating which goes first, and reports
the median epoch time of each and the median of the per-round ratios (target <= 1.03x).
When the target is missed, a profile of the elastic side's extra work is printed.

Run: ``python benchmarks/loader_overhead.py`` (``ELASTIC_BATCHES_BENCH_QUICK=1``: fewer rounds).
"""

from __future__ import annotations

import cProfile
import io
import pstats
from typing import Any

import torch
from _harness import QUICK, configure_threads, emit, interleaved, median, paired_ratio, table
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from elastic_batches import MicrobatchingDataLoader

TARGET = 1.03
ROUNDS = 5 if QUICK else 21
EPOCH = 40 if QUICK else 100  # batches per epoch
BATCH = 64


class TextDataset(Dataset[dict[str, Any]]):
    """Windows of a token stream, as a tokenised-text dataset yields them."""

    def __init__(self, samples: int, seq_len: int = 128, vocab: int = 32000) -> None:
        g = torch.Generator().manual_seed(0)
        self.stream = torch.randint(vocab, (samples * seq_len + seq_len,), generator=g)
        self.offsets = torch.randint(samples * seq_len, (samples,), generator=g).tolist()
        self.labels = torch.randint(2, (samples,), generator=g).tolist()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> dict[str, Any]:
        start = self.offsets[index]
        ids = self.stream[start : start + self.seq_len].clone()
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "label": self.labels[index]}


class ImageDataset(Dataset[tuple[torch.Tensor, int]]):
    """uint8 images decoded to normalised float and randomly flipped, as a vision dataset yields them."""

    def __init__(self, samples: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(256, (samples, 3, 32, 32), dtype=torch.uint8, generator=g)
        self.labels = torch.randint(10, (samples,), generator=g).tolist()
        self.mean = torch.tensor([0.49, 0.48, 0.45]).view(3, 1, 1)
        self.std = torch.tensor([0.25, 0.24, 0.26]).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = (self.images[index].float() / 255.0 - self.mean) / self.std
        if index % 2:
            image = image.flip(-1)
        return image, self.labels[index]


def _epoch(loader: DataLoader[Any]) -> None:
    for _ in loader:
        pass


def _epoch_taken_apart(loader: MicrobatchingDataLoader) -> None:
    for batch in loader:
        batch.fields  # noqa: B018 - takes a deferred batch apart, as the step's first cut does


def _profile_elastic(loader: DataLoader[Any]) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    _epoch(loader)
    profiler.disable()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream).sort_stats("cumulative")
    stats.print_stats("elastic_batches|tensordict|stateful_dataloader", 15)
    return stream.getvalue()


def main() -> None:
    threads = configure_threads()
    configs = [
        ("text", TextDataset(BATCH * EPOCH), 0),
        ("image", ImageDataset(BATCH * EPOCH), 0),
        ("text", TextDataset(BATCH * EPOCH), 2),
    ]
    rows = []
    records = []
    for name, dataset, workers in configs:
        kwargs: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, "num_workers": workers}
        if workers:
            kwargs["persistent_workers"] = True
        plain = DataLoader(dataset, generator=torch.Generator().manual_seed(0), **kwargs)
        stateful = StatefulDataLoader(dataset, generator=torch.Generator().manual_seed(0), **kwargs)
        elastic = MicrobatchingDataLoader(DataLoader(dataset, generator=torch.Generator().manual_seed(0), **kwargs))
        times = interleaved(
            {
                "plain": lambda p=plain: _epoch(p),
                "stateful": lambda s=stateful: _epoch(s),
                "elastic": lambda e=elastic: _epoch(e),
                "taken apart": lambda e=elastic: _epoch_taken_apart(e),
            },
            ROUNDS,
        )
        batches = len(plain)
        ratio = paired_ratio(times["elastic"], times["plain"])
        stateful_ratio = paired_ratio(times["stateful"], times["plain"])
        own_ratio = paired_ratio(times["elastic"], times["stateful"])
        apart_ratio = paired_ratio(times["taken apart"], times["plain"])
        plain_ms = 1e3 * median(times["plain"]) / batches
        stateful_ms = 1e3 * median(times["stateful"]) / batches
        elastic_ms = 1e3 * median(times["elastic"]) / batches
        label = f"{name}, {workers} workers"
        rows.append(
            [
                label,
                batches,
                plain_ms,
                stateful_ms,
                elastic_ms,
                1e3 * (elastic_ms - plain_ms),
                stateful_ratio,
                own_ratio,
                ratio,
                ratio <= TARGET,
                apart_ratio,
            ]
        )
        record = {
            "benchmark": "loader_overhead",
            "dataset": name,
            "num_workers": workers,
            "batch_size": BATCH,
            "batches": batches,
            "rounds": ROUNDS,
            "plain_ms_per_batch": plain_ms,
            "stateful_ms_per_batch": stateful_ms,
            "elastic_ms_per_batch": elastic_ms,
            "ratio": ratio,
            "stateful_over_plain": stateful_ratio,
            "elastic_over_stateful": own_ratio,
            "taken_apart_over_plain": apart_ratio,
            "target": TARGET,
            "met": ratio <= TARGET,
        }
        records.append(record)
        if ratio > TARGET and workers == 0:
            print(f"--- {label}: {ratio:.3f}x is over the {TARGET}x target; where the elastic epoch spends its time:")
            print(_profile_elastic(elastic))
        del plain, stateful, elastic
    print(f"loader overhead: batch {BATCH}, median of {ROUNDS} interleaved epochs, {threads}")
    print(
        "plain: torch DataLoader; stateful: torchdata StatefulDataLoader, the base class of MicrobatchingDataLoader "
        "(mid-epoch state_dict); elastic: MicrobatchingDataLoader wrapping the plain loader"
    )
    print(
        table(
            [
                "dataset",
                "batches",
                "plain ms/batch",
                "stateful ms/batch",
                "elastic ms/batch",
                "extra us/batch",
                "stateful/plain",
                "elastic/stateful",
                "elastic/plain",
                "<= 1.03",
                "elastic, taken apart/plain",
            ],
            rows,
        )
    )
    for record in records:
        emit(record)


if __name__ == "__main__":
    main()

"""Run as ``__main__`` by tests/test_loader.py: registrations made here must reach ``spawn`` workers.

The registrations run only under ``if __name__ == "__main__"``, so a worker that re-imports this
file (as ``__mp_main__``) does not make them itself: only the loader's pickled collate can bring
them. The default collate batches the ``Point`` fields with the registered collate function,
which returns a ``Pair``, a class the library splits only through its registered converters. One
loader, two spawn workers, two epochs with persistent workers. Prints one JSON line describing
what the main process received.
"""

from __future__ import annotations

import json
import os

import torch

import elastic_batches as eb


class Pair:
    """A batch class the library cannot take apart without a registration."""

    def __init__(self, x: torch.Tensor, names: list[str]) -> None:
        self.x, self.names = x, names


class Point:
    """A sample field type that torch's default collate cannot batch without a registration."""

    def __init__(self, i: int) -> None:
        self.i = i


def pair_fields(pair: Pair) -> dict[str, object]:
    return {"x": pair.x, "names": pair.names}


def pair_rebuild(fields: dict[str, object]) -> Pair:
    return Pair(fields["x"], fields["names"])  # type: ignore[arg-type]


def collate_points(points: list[Point], *, collate_fn_map: object = None) -> Pair:
    """Runs in a worker: records its pid next to each row."""
    return Pair(torch.tensor([[float(p.i), float(os.getpid())] for p in points]), [f"s{p.i}" for p in points])


def main() -> None:
    eb.register_batch_type(Pair, to_tensordict=pair_fields, from_tensordict=pair_rebuild)
    eb.register_collate(Point, collate_points)
    samples = [{"point": Point(i), "i": i} for i in range(12)]
    loader = eb.MicrobatchingDataLoader(
        samples, batch_size=4, num_workers=2, multiprocessing_context="spawn", persistent_workers=True
    )
    epochs = []
    for _ in range(2):
        rows, pids, types = [], set(), set()
        for batch in loader:
            for mb in batch.microbatches(2):
                item = mb.unwrap()
                pair = item["point"]
                types.add(type(pair).__qualname__)
                rows.append([int(v) for v in pair.x[:, 0].tolist()])
                pids.update(int(v) for v in pair.x[:, 1].tolist())
                assert pair.names == [f"s{r}" for r in rows[-1]], pair.names
                assert item["i"].tolist() == rows[-1], item["i"]
        epochs.append({"rows": rows, "types": sorted(types), "pids": sorted(pids)})
    print(json.dumps({"main_pid": os.getpid(), "epochs": epochs}))


if __name__ == "__main__":
    main()

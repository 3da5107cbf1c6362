"""Search quality: how large a microbatch each policy settles on, and how many OOMs it spends.

A size oracle stands in for the device: a microbatch of ``s`` rows fits when ``s <= largest``.
Over a sweep of batch sizes ``B`` and limits ``largest``, each policy trains ``STEPS`` steps on
batches of ``B`` rows, through the same harness:

* ``elastic``: this library's ``SplitController`` (halving until something fits, then bisection
  between the largest size that fitted and the smallest that failed, any integer count, balanced
  splits);
* ``halving``: halve the microbatch size on each OOM and never grow back, as Composer's
  ``device_train_microbatch_size="auto"`` does (``6 -> 3 -> 1``);
* ``decay0.9``: multiply the size by 0.9 on each OOM (``int(size * 0.9)``), as Accelerate's
  ``find_executable_batch_size`` does, here used to pick the microbatch size.

Each batch is retried until it fits; a step's cost is the number of microbatches it runs. Reported
per run: the settled microbatch size over ``largest`` (1.0 is perfect), the settled count over the
fewest microbatches possible (``ceil(B / largest)``), the OOMs spent in all, and the OOMs after the
first successful step at the settled size (0 is required). The library's targets: size ratio
>= 0.9 (of what a balanced split of ``B`` can reach) and at most ``ceil(log2(B)) + 4`` OOMs.

A second table runs sequences of batch sizes: a small batch first (a smoke test, a last partial
batch), then larger ones that fit whole; a success must not cap the later batches.

A third runs the demo's tiny transformer LM under ``testing.MemoryBudget`` (real tensors, real
``torch.OutOfMemoryError``), batches of 16, 100, 256 and 1000 rows, and a sweep of limits: for each
of a set of counts ``k``, the limit is the peak of a step at ``k`` balanced microbatches (the
count just fits: the hardest case for a margin) and, from ``k = 2``, the middle between that and
the peak at ``k - 1``. Four policies side by side (``benchmarks/_policies.py``): ``predicted``
(the memory model, the budget as the step's probe), ``search`` (the same controller without a
margin: today's search), ``halving`` (Composer) and ``x0.9`` (Accelerate). Per case: the fewest
microbatches whose balanced split fits (measured by running the splits), the OOMs spent until the
count stopped changing, the settled count, and the OOMs after it; a policy that runs out of memory
at its smallest microbatch ends its case there, shown as ``raised``. The predictor's targets: 0 OOMs
until settled in at least 90% of the cases and at most 1 in every case; settled at most
``max(fewest + 1, 1.10 * fewest)`` microbatches, and no OOM after.

``--allocator caching`` (or ``expandable``) runs the third table under the caching-allocator
simulation (``MemoryBudget(allocator=...)``: limits, peaks and the probe's capacity are then in
reserved bytes, segments and their unused ends included), and ``--model heavy`` on a transformer
whose activations are MiB-sized (so that segment sizes matter), ``--model large`` on a wider one
(sequence 512, width 256: tensors of 2 MiB a row, so that most blocks have segments of their own
and limits run from 44 to 821 MiB; about 4 minutes with ``ELASTIC_BATCHES_BENCH_QUICK=1``),
``--model gradients`` on an MLP 8-128-128-1 whose peak is mostly the gradient being accumulated
(bytes per microbatch) and ``--model activations`` on an MLP 8-1024-1 whose peak is mostly
activations (bytes per row), each on batches of 128 and 512 rows; ``--lm-only`` skips the first
two tables. With a predictor, the table also counts the runs whose margin grew (an OOM the memory
model did not predict).
``--long`` runs the predicted policy alone, 40 steps a case (three narrowings of a widened margin
or more: after 8 calm batches, 16 and 32 after an OOM soon after one), and counts the OOMs after its
first step and the steps they happened in.

Run: ``python benchmarks/search_quality.py`` (no timing involved: the numbers are exact;
``ELASTIC_BATCHES_BENCH_QUICK=1``: fewer steps, counts and, for the tiny LM, batches of 16 and 256 only).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
from _harness import QUICK, emit, table
from _policies import POLICIES as LM_POLICIES
from _policies import Policy, make, peak_at
from _policies import fewest as fewest_count

from elastic_batches import ElasticBatch, ElasticOOMError, SplitController
from elastic_batches.demo import DemoConfig
from elastic_batches.demo_model import lm_loss
from elastic_batches.memory import RECOVER_AFTER
from elastic_batches.testing import MemoryBudget

STEPS = 30 if QUICK else 60


class _Policy:
    """The interface every policy is driven through: a count to try, then what happened."""

    def plan(self, rows: int) -> int:
        """Rows of the largest microbatch of the next attempt on a batch of ``rows`` rows."""
        raise NotImplementedError

    def success(self, size: int, rows: int) -> None:
        raise NotImplementedError

    def oom(self, size: int, rows: int) -> None:
        raise NotImplementedError


class _Elastic(_Policy):
    def __init__(self) -> None:
        self.controller = SplitController()

    def plan(self, rows: int) -> int:
        return math.ceil(rows / self.controller.plan(rows))  # balanced pieces: 10 rows / 3 -> 4, 3, 3

    def success(self, size: int, rows: int) -> None:
        self.controller.record_success(size, rows)

    def oom(self, size: int, rows: int) -> None:
        self.controller.record_oom(size, rows, discarded=1)


class _SizeSearch(_Policy):
    """A microbatch size, shrunk by ``shrink`` on each OOM, never grown."""

    def __init__(self, shrink: Callable[[int], int]) -> None:
        self.size: int | None = None
        self.shrink = shrink

    def plan(self, rows: int) -> int:
        return rows if self.size is None else min(self.size, rows)  # pieces of `size` rows and a remainder

    def success(self, size: int, rows: int) -> None:
        pass  # a size is learned from OOMs only: a small batch that fitted does not shrink it

    def oom(self, size: int, rows: int) -> None:
        new = self.shrink(size)
        if new < 1:
            raise ElasticOOMError(f"no executable microbatch size below {size}")
        self.size = new


def _halving(size: int) -> int:
    return max(int(size / 2), 1) if size > 1 else 0  # Composer: max(int(size / 2), 1), stops at 1


def _decay(size: int) -> int:
    return int(size * 0.9)  # Accelerate: int(batch_size * 0.9), stops at 0


POLICIES: dict[str, Callable[[], _Policy]] = {
    "elastic": _Elastic,
    "halving": lambda: _SizeSearch(_halving),
    "decay0.9": lambda: _SizeSearch(_decay),
}


def run(policy_name: str, rows: int, largest: int, steps: int = STEPS) -> dict[str, float | int | str]:
    policy = POLICIES[policy_name]()
    ooms = 0
    ooms_after_settled = 0
    settled: int | None = None
    sizes: list[int] = []
    for _ in range(steps):
        while True:
            size = policy.plan(rows)
            if size <= largest:
                policy.success(size, rows)
                sizes.append(size)
                break
            ooms += 1
            if settled is not None and size <= settled:
                ooms_after_settled += 1
            policy.oom(size, rows)
        if settled is None and len(sizes) >= 2 and sizes[-1] == sizes[-2]:
            settled = sizes[-1]
    final = sizes[-1]
    fewest = math.ceil(rows / largest) if largest < rows else 1
    best_size = math.ceil(rows / fewest)  # the largest piece a balanced split of `rows` can reach
    count = math.ceil(rows / final)
    return {
        "policy": policy_name,
        "batch": rows,
        "largest": largest,
        "settled_size": final,
        "size_ratio": final / min(largest, rows),
        "size_ratio_reachable": final / best_size,
        "count": count,
        "fewest_count": fewest,
        "count_ratio": count / fewest,
        "ooms": ooms,
        "oom_bound": math.ceil(math.log2(rows)) + 4,
        "ooms_at_or_below_settled": ooms_after_settled,
    }


def run_sequence(policy_name: str, batches: list[int], largest: int) -> tuple[list[int], int]:
    """Train on batches of the given rows in turn; the microbatches each ran as, and the OOMs spent."""
    policy = POLICIES[policy_name]()
    counts, ooms = [], 0
    for rows in batches:
        while True:
            size = policy.plan(rows)
            if size <= largest:
                policy.success(size, rows)
                counts.append(math.ceil(rows / size))
                break
            ooms += 1
            policy.oom(size, rows)
    return counts, ooms


# A small batch first, or batches smaller than the later ones: what fitted is a lower bound, never a ceiling.
SEQUENCES = {
    "8 rows once, then 1024 (fits whole)": ([8] + [1024] * 20, 1024, 20),
    "256 rows x 20, then 300 (fits whole)": ([256] * 20 + [300] * 20, 300, 20),
    "256 rows x 20, then 300 (fits 280)": ([256] * 20 + [300] * 20, 280, 20),
}


def sequences() -> list[list[object]]:
    """Per sequence and policy: microbatches of each of the later batches (max), fewest possible, OOMs."""
    rows_out: list[list[object]] = []
    for name, (batches, largest, later) in SEQUENCES.items():
        fewest = math.ceil(batches[-1] / largest)
        row: list[object] = [name, fewest]
        for policy in POLICIES:
            counts, ooms = run_sequence(policy, batches, largest)
            row += [max(counts[-later:]), ooms]
            emit(
                {
                    "benchmark": "search_quality_sequence",
                    "sequence": name,
                    "policy": policy,
                    "later_microbatches": max(counts[-later:]),
                    "fewest": fewest,
                    "ooms": ooms,
                }
            )
        rows_out.append(row)
    return rows_out


def sweep() -> list[tuple[int, int]]:
    cases = []
    for rows in (64, 256, 1000, 4096):
        limits = {1, 3, 7, 47, rows // 10, rows // 3, rows // 2 + 1, (3 * rows) // 4, rows - 1, rows}
        cases.extend((rows, largest) for largest in sorted(limit for limit in limits if 1 <= limit <= rows))
    return cases


def main() -> None:
    results = [run(name, rows, largest) for rows, largest in sweep() for name in POLICIES]
    by_case: dict[tuple[int, int], dict[str, dict[str, float | int | str]]] = {}
    for r in results:
        by_case.setdefault((int(r["batch"]), int(r["largest"])), {})[str(r["policy"])] = r

    headers = ["B", "largest fits"]
    for name in POLICIES:
        headers += [f"{name} size/largest", f"{name} count/fewest", f"{name} OOMs"]
    rows_out = []
    for (rows, largest), per in sorted(by_case.items()):
        row: list[object] = [rows, largest]
        for name in POLICIES:
            r = per[name]
            row += [float(r["size_ratio"]), float(r["count_ratio"]), int(r["ooms"])]
        rows_out.append(row)
    print(f"search quality over {len(by_case)} (batch, limit) cases, {STEPS} steps each")
    print(table(headers, rows_out))

    summary = []
    for name in POLICIES:
        rs = [r for r in results if r["policy"] == name]
        summary.append(
            [
                name,
                min(float(r["size_ratio_reachable"]) for r in rs),
                sum(float(r["size_ratio"]) for r in rs) / len(rs),
                max(float(r["count_ratio"]) for r in rs),
                sum(float(r["count_ratio"]) for r in rs) / len(rs),
                max(int(r["ooms"]) for r in rs),
                sum(int(r["ooms"]) for r in rs) / len(rs),
                sum(int(r["ooms"]) > int(r["oom_bound"]) for r in rs),
                sum(int(r["ooms_at_or_below_settled"]) for r in rs),
            ]
        )
    print()
    print(
        table(
            [
                "policy",
                "min size/reachable",
                "mean size/largest",
                "max count/fewest",
                "mean count/fewest",
                "max OOMs",
                "mean OOMs",
                "cases over OOM bound",
                "OOMs at settled size",
            ],
            summary,
        )
    )
    print(
        "\nsize/reachable: settled size over the largest piece a balanced split of B can have under the limit "
        "(target >= 0.9); count/fewest: microbatches run per step over the fewest possible; "
        "OOM bound: ceil(log2(B)) + 4."
    )
    for r in results:
        record = {"benchmark": "search_quality", **r}
        if r["policy"] == "elastic":  # the library's targets; the other policies are what it is compared with
            record["target"] = "size_ratio_reachable >= 0.9, ooms <= oom_bound"
            record["met"] = float(r["size_ratio_reachable"]) >= 0.9 and int(r["ooms"]) <= int(r["oom_bound"])
        emit(record)
    headers = ["sequence", "fewest"]
    for name in POLICIES:
        headers += [f"{name} microbatches", f"{name} OOMs"]
    print("\nsequences of batch sizes (microbatches: the most any of the later batches ran as)")
    print(table(headers, sequences()))


LM = DemoConfig(seq_len=16, vocab_size=48, dim=32, heads=2, layers=1)
LM_BATCHES = (16, 256) if QUICK else (16, 100, 256, 1000)
LM_COUNTS = (1, 2, 3, 6, 16, 40) if QUICK else (1, 2, 3, 4, 6, 10, 16, 40, 100)
LM_STEPS = 5 if QUICK else 6
LONG_STEPS = 5 * RECOVER_AFTER  # --long: three narrowings of a widened margin or more
ALLOCATOR = "exact"  # --allocator: the MemoryBudget's allocator model
# --model heavy: activations of MiB (a batch of 64 holds 4 MiB per activation), where segment sizes matter
HEAVY = DemoConfig(seq_len=128, vocab_size=64, dim=128, heads=2, layers=1)
HEAVY_BATCHES = (16, 64)
HEAVY_COUNTS = (1, 2, 3, 4, 8) if QUICK else (1, 2, 3, 4, 6, 8, 16)
# --model large: tensors of 2 MiB a row (16 MiB at 8 rows), most blocks in segments of their own
LARGE = DemoConfig(seq_len=512, vocab_size=64, dim=256, heads=2, layers=1)
WIDENED: list[int] = []  # per predicted run: 1 if its margin grew
RAISED = 0  # the count of a step that ran out of memory at the policy's smallest microbatch


# --model gradients / activations: MLPs whose peak is mostly the gradient being accumulated (bytes per
# microbatch: a line through the origin took it for bytes per row) or mostly activations (bytes per row)
MLPS = {"gradients": (8, 128, 128, 1), "activations": (8, 1024, 1)}
MLP_BATCHES = (128, 512)
MLP_COUNTS = (1, 2, 3, 4, 6, 8, 16) if QUICK else (1, 2, 3, 4, 6, 8, 12, 16, 32)
WIDTHS: tuple[int, ...] | None = None  # set by --model gradients / activations


def _mlp(widths: tuple[int, ...]) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _loss(model: torch.nn.Module, mb: object) -> torch.Tensor:
    """The LM's token loss, or the MLP's mean squared error."""
    if WIDTHS is None:
        return lm_loss(model, mb)
    x, y = mb["x"], mb["y"]  # type: ignore[index]
    return (model(x) - y).pow(2).mean()


def _lm(rows: int) -> tuple[torch.nn.Module, ElasticBatch]:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(rows)
    if WIDTHS is not None:
        x = torch.randn(rows, WIDTHS[0], generator=generator)
        return _mlp(WIDTHS), ElasticBatch.wrap({"x": x, "y": torch.randn(rows, 1, generator=generator)})
    model = LM.model()
    tokens = torch.randint(LM.vocab_size, (rows, LM.seq_len + 1), generator=generator)
    return model, ElasticBatch.wrap({"tokens": tokens})


def _workload() -> str:
    if WIDTHS is not None:
        return f"MLP {'-'.join(map(str, WIDTHS))}"
    return f"{'memory-heavy' if LM is HEAVY else 'large' if LM is LARGE else 'tiny'} transformer LM"


def _peaks(rows: int) -> Callable[[int], int]:
    """Peak bytes of a step at a count, measured once per count."""
    model, batch = _lm(rows)
    peaks: dict[int, int] = {}

    def peak(count: int) -> int:
        if count not in peaks:
            peaks[count] = peak_at(model, lambda mb: _loss(model, mb), batch, count, allocator=ALLOCATOR)
        return peaks[count]

    return peak


def lm_cases() -> list[tuple[int, int, int, str]]:
    """``(rows, limit, fewest, kind)`` for every batch size and limit of the sweep.

    ``mid``: midway between the peak at ``k`` microbatches and the next peak more than 1% larger
    (at fewer microbatches; for ``k = 1``, 5% over the whole batch's peak), so that ``k`` is the fewest that
    fits, as a device's limit falls. ``edge``: the peak at ``k`` itself, to the byte.
    """
    cases = []
    for rows in LM_BATCHES:
        peak = _peaks(rows)
        limits: dict[int, str] = {}
        for k in (k for k in LM_COUNTS if k <= rows):
            larger = next((peak(j) for j in range(k - 1, 0, -1) if peak(j) > 1.01 * peak(k)), None)
            if larger is None:
                limits.setdefault(peak(k) + peak(k) // 20, "mid")
            else:
                limits.setdefault((peak(k) + larger) // 2, "mid")
            if not QUICK:
                limits.setdefault(peak(k), "edge")
        cases.extend((rows, limit, fewest_count(peak, rows, limit), kind) for limit, kind in sorted(limits.items()))
    return cases


def _steps(policy: str, rows: int, limit: int, steps: int) -> tuple[list[int], list[int], Policy]:
    """``policy`` trained ``steps`` steps on a batch of ``rows`` under ``limit``: each step's OOMs and count.

    A policy that runs out of memory at its smallest microbatch raises (``ElasticOOMError``, or the
    baselines' own OOM): that step counts one OOM and the count ``RAISED``, and the run ends there.
    """
    model, batch = _lm(rows)
    runner = make(policy, model, lambda mb: _loss(model, mb), MemoryBudget(limit, allocator=ALLOCATOR))
    ooms, counts = [], []
    for _ in range(steps):
        try:
            spent, count = runner.step(batch)
        except torch.OutOfMemoryError:
            ooms.append(1)
            counts.append(RAISED)
            break
        ooms.append(spent)
        counts.append(count)
    return ooms, counts, runner


def lm_run(policy: str, rows: int, limit: int) -> tuple[int, int, int, list[int]]:
    """OOMs until the count stopped changing, the settled count, OOMs after it, and each step's count."""
    ooms, counts, runner = _steps(policy, rows, limit, LM_STEPS)
    memory = getattr(getattr(runner, "controller", None), "memory", None)
    if policy == "predicted" and memory is not None:
        WIDENED.append(int(memory.margin > 0.05))
    settled = next(i for i in range(len(counts)) if len(set(counts[i:])) == 1)
    return sum(ooms[: settled + 1]), counts[-1], sum(ooms[settled + 1 :]), counts


def _summary_row(name: str, results: list[tuple[int, float, int, bool]]) -> list[object]:
    return [
        name,
        len(results),
        f"{sum(r[0] == 0 for r in results) / len(results):.0%}",
        max(r[0] for r in results),
        sum(r[0] for r in results) / len(results),
        max(r[1] for r in results),
        sum(r[1] for r in results) / len(results),
        sum(not r[3] for r in results),
        sum(r[2] for r in results),
    ]


def lm_main() -> None:
    cases = lm_cases()
    rows_out = []
    summary: dict[tuple[str, str], list[tuple[int, float, int, bool]]] = {}
    for rows, limit, fewest, kind in cases:
        row: list[object] = [rows, kind, f"{limit / 2**20:.3f}", fewest]
        for policy in LM_POLICIES:
            to_settle, settled, after, counts = lm_run(policy, rows, limit)
            raised = settled == RAISED
            within = not raised and settled <= max(fewest + 1, 1.1 * fewest)
            ratio = math.inf if raised else settled / fewest
            summary.setdefault((policy, kind), []).append((to_settle, ratio, after, within))
            row += [to_settle, "raised" if raised else settled, after]
            record: dict[str, object] = {
                "benchmark": "search_quality_lm",
                "policy": policy,
                "batch": rows,
                "limit": kind,
                "limit_bytes": limit,
                "fewest": fewest,
                "ooms_until_settled": to_settle,
                "settled_microbatches": settled,
                "raised": raised,
                "ooms_after_settled": after,
                "microbatches_per_step": counts,
            }
            if policy == "predicted" and kind == "mid":
                record["target"] = "ooms_until_settled <= 1, settled <= max(fewest + 1, 1.1 fewest), no OOM after"
                record["met"] = to_settle <= 1 and after == 0 and within
            emit(record)
        rows_out.append(row)
    headers = ["B", "limit", "MiB", "fewest"]
    for policy in LM_POLICIES:
        headers += [f"{policy} OOMs", f"{policy} mbs", f"{policy} OOMs after"]
    print(
        f"\n{_workload()} under MemoryBudget(allocator={ALLOCATOR!r}): "
        f"{len(cases)} (batch, limit) cases, {LM_STEPS} steps each"
    )
    print(table(headers, rows_out))
    lines = [_summary_row(f"{policy}, {kind}", results) for (policy, kind), results in sorted(summary.items())]
    mid = summary[("predicted", "mid")]
    zero = sum(r[0] == 0 for r in mid) / len(mid)
    emit(
        {
            "benchmark": "search_quality_lm_summary",
            "policy": "predicted",
            "cases": len(mid),
            "share_settled_without_oom": zero,
            "target": "share_settled_without_oom >= 0.9",
            "met": zero >= 0.9,
            "allocator": ALLOCATOR,
            "margin_widened_runs": sum(WIDENED),
        }
    )
    print(f"predicted: the margin grew (an OOM the model did not predict) in {sum(WIDENED)} of {len(WIDENED)} runs")
    print()
    print(
        table(
            [
                "policy, limits",
                "cases",
                "0 OOMs",
                "max OOMs",
                "mean OOMs",
                "max mbs / fewest",
                "mean mbs / fewest",
                "over max(fewest + 1, 1.1 fewest)",
                "OOMs after settled",
            ],
            lines,
        )
    )
    print(
        "\nmid: limits midway between two splits' peaks (the targets); edge: a split's peak to the byte, where any "
        "margin costs a row of every microbatch"
    )


def long_main() -> None:
    """The predicted policy over ``LONG_STEPS`` steps a case: the OOMs after its first step, and when."""
    rows_out = []
    for rows, limit, fewest, kind in lm_cases():
        ooms, counts, _ = _steps("predicted", rows, limit, LONG_STEPS)
        late = [i + 1 for i, spent in enumerate(ooms) if spent and i > 0]  # 1-based steps, the first left out
        after = sum(ooms[1:])
        emit(
            {
                "benchmark": "search_quality_lm_long",
                "policy": "predicted",
                "allocator": ALLOCATOR,
                "batch": rows,
                "limit": kind,
                "limit_bytes": limit,
                "fewest": fewest,
                "steps": LONG_STEPS,
                "ooms_first_step": ooms[0],
                "ooms_after_first_step": after,
                "steps_with_an_oom_after_the_first": late,
                "last_microbatches": counts[-1],
            }
        )
        last = "raised" if counts[-1] == RAISED else counts[-1]
        rows_out.append([rows, kind, f"{limit / 2**20:.3f}", fewest, ooms[0], after, late or "", last])
    print(f"\npredicted, {_workload()} under MemoryBudget(allocator={ALLOCATOR!r}), {LONG_STEPS} steps a case")
    headers = ["B", "limit", "MiB", "fewest", "OOMs step 1", "OOMs after", "steps with an OOM after", "last mbs"]
    print(table(headers, rows_out))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allocator", choices=["exact", "caching", "expandable"], default="exact")
    parser.add_argument("--model", choices=["tiny", "heavy", "large", *MLPS], default="tiny")
    parser.add_argument("--lm-only", action="store_true", help="skip the size-oracle tables")
    parser.add_argument("--long", action="store_true", help=f"only the predicted policy, {LONG_STEPS} steps a case")
    args = parser.parse_args()
    ALLOCATOR = args.allocator
    if args.model == "heavy":
        LM, LM_BATCHES, LM_COUNTS = HEAVY, HEAVY_BATCHES, HEAVY_COUNTS
    elif args.model == "large":
        LM, LM_BATCHES, LM_COUNTS = LARGE, HEAVY_BATCHES, HEAVY_COUNTS
    elif args.model in MLPS:
        WIDTHS, LM_BATCHES, LM_COUNTS = MLPS[args.model], MLP_BATCHES, MLP_COUNTS
    if args.long:
        long_main()
    else:
        if not args.lm_only:
            main()
        lm_main()

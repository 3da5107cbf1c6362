"""``python -m elastic_batches {demo,bench}``: the commands behind ``make demo`` and ``make bench``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic_batches._version import __version__


def _benchmarks_dir() -> Path | None:
    """The repository's ``benchmarks/`` folder (it is not installed with the package)."""
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        candidate = root / "benchmarks"
        if candidate.is_dir():
            return candidate
    return None


def _missed_targets(script: str, lines: Sequence[str]) -> list[str]:
    """The JSON records of a benchmark's output that state a target (``"met"``) and missed it."""
    missed = []
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            record: Any = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("met") is False:
            what = {k: v for k, v in record.items() if isinstance(v, (str, int)) and k not in ("benchmark", "met")}
            missed.append(f"{script}: {json.dumps(what, sort_keys=True)} (target {record.get('target')})")
    return missed


def _run_script(script: Path, env: dict[str, str], cwd: Path) -> tuple[int, list[str]]:
    """Run one benchmark script, its output passed through as it comes; its exit code and stdout lines."""
    lines = []
    with subprocess.Popen(
        [sys.executable, str(script)], env=env, cwd=cwd, stdout=subprocess.PIPE, text=True, bufsize=1
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line.rstrip("\n"))
    return process.returncode, lines


def _bench(args: argparse.Namespace) -> int:
    """Run the benchmark scripts, each in its own process; 1 if any failed (or missed a target with --check)."""
    folder = _benchmarks_dir()
    if folder is None:
        print(
            "python -m elastic_batches bench: error: no benchmarks/ folder found next to the package or in the "
            "current directory; run it from a clone of the repository",
            file=sys.stderr,
        )
        return 2
    scripts = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    if args.names:
        scripts = [p for p in scripts if any(name in p.name for name in args.names)]
    if not scripts:
        print(
            f"python -m elastic_batches bench: error: no benchmark script matches {args.names} in {folder}",
            file=sys.stderr,
        )
        return 2
    env = dict(os.environ)
    if args.quick:
        env["ELASTIC_BATCHES_BENCH_QUICK"] = "1"
    failed, missed, checked = [], [], 0
    for script in scripts:
        print(f"\n=== {script.name} ===", flush=True)
        start = time.perf_counter()
        rc, lines = _run_script(script, env, folder.parent)
        print(f"=== {script.name}: exit {rc}, {time.perf_counter() - start:.1f}s ===", flush=True)
        if rc != 0:
            failed.append(script.name)
        missed += _missed_targets(script.name, lines)
        checked += sum(1 for line in lines if line.startswith("{") and '"met":' in line)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    if args.check:
        print(f"\ntargets: {checked - len(missed)} of {checked} met", flush=True)
        for line in missed:
            print(f"missed: {line}", file=sys.stderr)
    return 1 if failed or (args.check and missed) else 0


def _demo(args: argparse.Namespace) -> int:
    from elastic_batches.demo import main as demo_main

    return demo_main(args.rest)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m elastic_batches",
        description="elastic_batches: automatic gradient accumulation that survives out-of-memory errors.",
    )
    parser.add_argument("--version", action="version", version=f"elastic_batches {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench}")
    demo = commands.add_parser(
        "demo",
        help="train a tiny LM under a memory limit, split on OOM, and check it against full-batch training",
        add_help=False,  # its own options and --help are the demo's (python -m elastic_batches demo --help)
    )
    demo.set_defaults(run=_demo)
    bench = commands.add_parser(
        "bench",
        help="run the scripts of benchmarks/",
        description="Run the benchmark scripts in benchmarks/ one after the other, each in its own process; each "
        'prints a table of ratios measured side by side, and JSON lines (a record with "met" states a target).',
    )
    bench.add_argument("names", nargs="*", help="run only the scripts whose file name contains one of these")
    bench.add_argument("--quick", action="store_true", help="fewer repeats (sets ELASTIC_BATCHES_BENCH_QUICK=1)")
    bench.add_argument(
        "--check", action="store_true", help="exit 1 when a benchmark misses a target it states (not only on a crash)"
    )
    bench.set_defaults(run=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; returns the process exit code (argparse exits 2 on a usage error, 0 after ``--help``)."""
    parser = _parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if rest and args.command != "demo":  # the demo parses its own options
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())

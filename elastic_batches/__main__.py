"""``python -m elastic_batches demo | bench``: the two commands behind ``make demo`` and ``make bench``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def _benchmarks_dir() -> Path | None:
    """The repository's ``benchmarks/`` folder (it is not installed with the package)."""
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        candidate = root / "benchmarks"
        if candidate.is_dir():
            return candidate
    return None


def _bench(argv: Sequence[str]) -> int:
    """Run the benchmark scripts, each in its own process; 1 if any failed, 2 if none matched."""
    parser = argparse.ArgumentParser(
        prog="python -m elastic_batches bench",
        description="Run the benchmark scripts in benchmarks/ one after the other, each in its own process; each "
        "prints a table of ratios measured side by side, and JSON lines.",
    )
    parser.add_argument("names", nargs="*", help="run only the scripts whose file name contains one of these")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (sets ELASTIC_BATCHES_BENCH_QUICK=1)")
    args = parser.parse_args(argv)
    folder = _benchmarks_dir()
    if folder is None:
        print(
            "python -m elastic_batches bench: no benchmarks/ folder found next to the package or in the current "
            "directory; run it from a clone of the repository",
            file=sys.stderr,
        )
        return 2
    scripts = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    if args.names:
        scripts = [p for p in scripts if any(name in p.name for name in args.names)]
    if not scripts:
        print(f"python -m elastic_batches bench: no benchmark script matches {args.names} in {folder}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if args.quick:
        env["ELASTIC_BATCHES_BENCH_QUICK"] = "1"
    failed = []
    for script in scripts:
        print(f"\n=== {script.name} ===", flush=True)
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, str(script)], env=env, cwd=folder.parent)
        print(f"=== {script.name}: exit {rc}, {time.perf_counter() - start:.1f}s ===", flush=True)
        if rc != 0:
            failed.append(script.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``demo`` or ``bench``; returns the process exit code (2 for a usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "train a tiny LM under a simulated memory limit and check it", "bench": "run benchmarks/"}
    if not argv or argv[0] not in commands:
        usage = "\n".join(f"  {name:6} {text}" for name, text in commands.items())
        print(f"usage: python -m elastic_batches {{demo,bench}} [options]\n{usage}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "demo":
        from elastic_batches.demo import main as demo_main

        return demo_main(argv[1:])
    return _bench(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

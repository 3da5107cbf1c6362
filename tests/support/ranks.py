"""Spawned gloo ranks that run test cases, with a hard deadline that turns a hang into a failure.

For testing distributed training on a CPU: every rank is a process of its own on the gloo
backend, and a case that leaves a rank waiting in a collective fails with each rank's stack
instead of freezing the test suite.

A :class:`RankPool` starts ``world_size`` processes once (``spawn``; a ``file://`` rendezvous in
a temporary folder, so no port is ever fixed) and runs test cases on all of them: each case is
a module-level function ``fn(rank, world_size, *args, **kwargs)`` whose return value (plain
Python values, pickled) comes back per rank.
Starting the ranks once per test module, not per case, keeps the suite fast: importing torch
twice costs more than most cases.

When a case is not finished on every rank within its deadline, the pool asks every live rank
for its stack (``faulthandler`` on ``SIGUSR1``), kills them, and raises
:class:`RankFailure` with each rank's traceback; the next case starts fresh ranks. A case
that raises on some rank fails the same way once every rank has answered.
"""

from __future__ import annotations

import faulthandler
import itertools
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

__all__ = ["RankFailure", "RankPool"]


class RankFailure(AssertionError):
    """A case raised on some rank, or did not finish on every rank before its deadline."""


def _serve(rank: int, world_size: int, init_file: str, stack_file: str, inbox: Any, outbox: Any) -> None:
    """A rank's loop: run the cases it is sent until it is sent ``None``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    stacks = open(stack_file, "w")  # noqa: SIM115 - open for the life of the process
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    outbox.put(("ready", rank, True, None))
    while True:
        message = inbox.get()
        if message is None:
            break
        case_id, fn, args, kwargs = message
        try:
            result = fn(rank, world_size, *args, **kwargs)
        except BaseException:
            outbox.put((case_id, rank, False, traceback.format_exc()))
        else:
            outbox.put((case_id, rank, True, result))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` gloo ranks in spawned processes that run test cases under a deadline.

    Args:
        workdir: A fresh folder for the rendezvous files and the ranks' stack dumps.
        world_size: Number of ranks.
        start_timeout: Seconds the ranks may take to start and join the process group.

    Example:
        >>> import operator, tempfile
        >>> from support.ranks import RankPool
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     pool = RankPool(folder, world_size=2)
        ...     try:
        ...         results = pool.run(operator.add, timeout=60)  # each rank's rank + world_size
        ...     finally:
        ...         pool.close()
        >>> results
        [2, 3]
    """

    def __init__(self, workdir: Path, world_size: int = 2, start_timeout: float = 120.0) -> None:
        self.workdir = Path(workdir)
        self.world_size = world_size
        self.start_timeout = start_timeout
        self._generation = itertools.count()
        self._cases = itertools.count()
        self._processes: list[Any] = []

    def _start(self) -> None:
        generation = next(self._generation)
        context = mp.get_context("spawn")
        init_file = self.workdir / f"rendezvous-{generation}"
        self._stack_files = [self.workdir / f"stacks-{generation}-rank{r}.txt" for r in range(self.world_size)]
        self._inboxes = [context.Queue() for _ in range(self.world_size)]
        self._outbox = context.Queue()
        self._processes = [
            context.Process(
                target=_serve,
                args=(r, self.world_size, str(init_file), str(self._stack_files[r]), self._inboxes[r], self._outbox),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for process in self._processes:
            process.start()
        self._collect("ready", self.start_timeout, "start and join the process group")

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; its return values, by rank.

        Raises:
            RankFailure: a rank raised (its traceback), or some rank had not finished after
                ``timeout`` seconds (every live rank's stack; the ranks are then killed).
        """
        if not self._processes or not all(p.is_alive() for p in self._processes):
            self.close()
            self._start()
        case_id = f"{fn.__name__}-{next(self._cases)}"
        for inbox in self._inboxes:
            inbox.put((case_id, fn, args, kwargs))
        return self._collect(case_id, timeout, f"finish {fn.__name__}")

    def _collect(self, case_id: str, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, tuple[bool, Any]] = {}
        while len(results) < self.world_size:
            left = deadline - time.monotonic()
            dead = [r for r, p in enumerate(self._processes) if r not in results and not p.is_alive()]
            if left <= 0 or dead:
                self._fail(case_id, timeout, what, results, dead)
            try:
                answer_id, rank, ok, value = self._outbox.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if answer_id == case_id:
                results[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in results.items() if not ok}
        if failed:
            report = "\n".join(f"--- rank {r} raised:\n{tb}" for r, tb in sorted(failed.items()))
            raise RankFailure(f"{case_id}: rank(s) {sorted(failed)} raised\n{report}")
        return [results[r][1] for r in range(self.world_size)]

    def _fail(self, case_id: str, timeout: float, what: str, results: dict[int, Any], dead: list[int]) -> None:
        live = [r for r, p in enumerate(self._processes) if p.is_alive() and r not in results]
        for r in live:
            os.kill(self._processes[r].pid, signal.SIGUSR1)
        time.sleep(1.0)  # let faulthandler write
        stacks = []
        for r in range(self.world_size):
            if r in results:
                ok, value = results[r]
                outcome = "returned" if ok else f"raised:\n{value}"
                stacks.append(f"--- rank {r} finished, {outcome}")
                continue
            text = self._stack_files[r].read_text() if self._stack_files[r].exists() else ""
            state = "died" if r in dead else "still running, killed"
            stacks.append(f"--- rank {r} {state}; its stack:\n{text.strip() or '(none written)'}")
        self.close(force=True)
        reason = f"rank(s) {dead} died" if dead else f"rank(s) {live} did not {what} within {timeout:.0f} s"
        raise RankFailure(f"{case_id}: {reason}\n" + "\n".join(stacks))

    def close(self, force: bool = False) -> None:
        """Stop the ranks: politely if they are idle, by force otherwise (or at once with ``force``)."""
        for inbox, process in zip(getattr(self, "_inboxes", []), self._processes, strict=False):
            if force:
                process.kill()
            elif process.is_alive():
                try:
                    inbox.put(None)
                except (OSError, ValueError):
                    pass
        for process in self._processes:
            process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
        self._processes = []

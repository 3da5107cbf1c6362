"""Run by tests/test_examples.py: the Python code blocks of one Markdown page, in order, in one namespace.

As a reader would paste them into one session. Each page runs in a process of its own (a page
may configure logging, register batch types or start a process group) and in the working
directory it is given. A failing block is named in the traceback as ``PAGE[block N]``.

A top-level ``print(...)  # comment`` states what it prints: every number (and ``True`` /
``False``) in the comment must be among those the call printed, or the page fails naming the
line. Prose around them is free; a number the block does not print must not be shown there.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

_VALUE = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?|True|False")


def python_blocks(markdown: str) -> list[str]:
    """The code of every block fenced as ``python``."""
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL)


@contextlib.contextmanager
def printed_as(comment: str, where: str) -> Iterator[None]:
    """Run a ``print`` whose output must hold every number of ``comment``; the output is passed on."""
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        yield
    output = captured.getvalue()
    sys.stdout.write(output)
    printed = _VALUE.findall(output)
    missing = [value for value in _VALUE.findall(comment) if value not in printed]
    if missing:
        raise AssertionError(
            f"{where}: the comment shows {missing}, which the call did not print; it printed {output!r}"
        )


def _comment_of(line: str) -> str | None:
    """The comment of a one-line top-level ``print(...)`` statement, or ``None``."""
    if not line.startswith("print("):
        return None
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line).readline))
    except (tokenize.TokenError, SyntaxError):
        return None
    comments = [t for t in tokens if t.type == tokenize.COMMENT]
    return comments[0].string.lstrip("#").strip() if comments else None


def checked(block: str, where: str) -> str:
    """``block`` with each commented top-level ``print`` run inside :func:`printed_as`."""
    lines = []
    for number, line in enumerate(block.splitlines(), start=1):
        comment = _comment_of(line)
        if comment:
            line = f"with __printed_as__({comment!r}, {f'{where} line {number}'!r}): {line}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(page: str) -> int:
    path = Path(page)
    blocks = python_blocks(path.read_text())
    namespace: dict[str, object] = {"__name__": "__docs__", "__printed_as__": printed_as}
    for number, block in enumerate(blocks):
        where = f"{path.name}[block {number}]"
        exec(compile(checked(block, where), where, "exec"), namespace)  # noqa: S102 - our own docs
    print(f"{path.name}: {len(blocks)} blocks ran")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""Run by tests/test_examples.py: the Python code blocks of one Markdown page, in order, in one namespace.

As a reader would paste them into one session. Each page runs in a process of its own (a page
may configure logging, register batch types or start a process group) and in the working
directory it is given. A failing block is named in the traceback as ``PAGE[block N]``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def python_blocks(markdown: str) -> list[str]:
    """The code of every block fenced as ``python``."""
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL)


def main(page: str) -> int:
    path = Path(page)
    blocks = python_blocks(path.read_text())
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for number, block in enumerate(blocks):
        exec(compile(block, f"{path.name}[block {number}]", "exec"), namespace)  # noqa: S102 - our own docs
    print(f"{path.name}: {len(blocks)} blocks ran")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

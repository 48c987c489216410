"""The README's Python blocks: each is a complete program, run here, or marked a fragment.

A block is a fragment when the line just before its opening fence is
`<!-- fragment -->`; every other ```python block must run as written, as a
file of its own, and exit 0 (those that start a world start it embedded).
"""

from __future__ import annotations

import pathlib
import re

import pytest

from conftest import ROOT, run_program

FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks() -> list[tuple[int, str, bool]]:
    """(line, code, is a fragment) of every Python block of the README."""
    text = (ROOT / "README.md").read_text()
    found = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        found.append((line, match.group(1), before.strip() == "<!-- fragment -->"))
    return found


COMPLETE = [(line, code) for line, code, fragment in _blocks() if not fragment]


def test_the_readme_has_complete_blocks_and_marked_fragments() -> None:
    blocks = _blocks()
    assert len(COMPLETE) >= 6 and any(fragment for _, _, fragment in blocks)
    for line, code, fragment in blocks:
        if not fragment:  # a program: it imports what it uses
            assert "import asyncrpc" in code, f"README line {line}: no `import asyncrpc`"


@pytest.mark.subprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("line", "code"), COMPLETE, ids=[f"line {line}" for line, _ in COMPLETE])
def test_a_complete_readme_block_runs_as_written(
    line: int, code: str, tmp_path: pathlib.Path
) -> None:
    program = tmp_path / f"readme_line_{line}.py"
    program.write_text(code)
    done = run_program("python", str(program), timeout=110, cwd=tmp_path)
    assert done.returncode == 0, f"README line {line}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    assert done.stdout.strip(), f"README line {line} printed nothing"

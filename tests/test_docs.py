"""The docs: every Python block of the README and of docs/ runs, the site builds strictly,
and every public name is in its reference.

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


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks() -> list[tuple[str, str, bool]]:
    """(page:line, code, is a fragment) of every Python block of every page."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            where = f"{page.relative_to(ROOT)}:{line}"
            found.append((where, match.group(1), before.strip() == "<!-- fragment -->"))
    return found


COMPLETE = [(where, code) for where, code, fragment in _blocks() if not fragment]


def test_the_pages_have_complete_blocks_and_marked_fragments() -> None:
    blocks = _blocks()
    assert len(COMPLETE) >= 8 and any(fragment for _, _, fragment in blocks)
    for where, code, fragment in blocks:
        if not fragment:  # a program: it imports what it uses
            assert "import asyncrpc" in code, f"{where}: no `import asyncrpc`"


@pytest.mark.subprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("where", "code"), COMPLETE, ids=[where for where, _ in COMPLETE])
def test_a_complete_block_runs_as_written(where: str, code: str, tmp_path: pathlib.Path) -> None:
    program = tmp_path / f"{where.replace('/', '_').replace(':', '_line_')}.py"
    program.write_text(code)
    done = run_program("python", str(program), timeout=110, cwd=tmp_path)
    assert done.returncode == 0, f"{where}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    assert done.stdout.strip(), f"{where} printed nothing"


def test_the_readme_is_short_and_keeps_its_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 10_000, len(text.encode())
    commands = [line for line in text.splitlines() if line.startswith("python3 -m venv .venv")]
    assert len(commands) == 2 and all("pip install torch==2.13.0" in c for c in commands)
    assert commands[0].endswith("python examples/ring.py")
    assert commands[1].endswith("python -m pytest")


@pytest.mark.subprocess
@pytest.mark.timeout(180)
def test_the_site_builds_strictly_with_every_public_name_in_its_reference(
    tmp_path: pathlib.Path,
) -> None:
    pytest.importorskip("mkdocs", reason="the site needs mkdocs: pip install -e '.[docs]'")
    site = tmp_path / "site"
    done = run_program(
        "python", "-m", "mkdocs", "build", "--strict", "--site-dir", str(site),
        env={"NO_MKDOCS_2_WARNING": "1"}, timeout=170,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    reference = (site / "reference" / "index.html").read_text()
    import asyncrpc

    missing = [name for name in asyncrpc.__all__ if f'id="asyncrpc.{name}"' not in reference]
    assert not missing, f"not in the reference: {missing}"
    for page in ("hangs", "cancelling", "benchmarks", "changelog", "design"):
        assert (site / page / "index.html").exists(), page


def test_every_asyncrpc_name_the_pages_mention_exists() -> None:
    import importlib

    import asyncrpc

    missing = []
    for page in PAGES:
        for found in re.finditer(r"(?<![\w/.])asyncrpc\.([A-Za-z_]\w*)", page.read_text()):
            name = found.group(1)
            if name in asyncrpc.__all__:
                continue
            try:
                importlib.import_module(f"asyncrpc.{name}")  # a module the pages name
            except ImportError:
                missing.append(f"{page.relative_to(ROOT)}: asyncrpc.{name}")
    assert not missing, missing

"""docs/spark.md, the Spark user's guide, runs as a reader runs it: its Python blocks, in order, in one fresh
interpreter (each block builds on the ones before it, as in a notebook), from an empty working directory; and the
sections other documents point at exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.script_runs import ScriptRuns, register

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "spark.md"

#: printed after each block by the script the test runs, so a failure names the block that failed
DONE = "### guide block {} done"


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """``(language, text)`` of every fenced block of a Markdown file, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), flags=re.DOTALL | re.MULTILINE)


def python_blocks(path: Path) -> list[str]:
    return [text for language, text in fenced_blocks(path) if language == "python"]


def guide_script() -> str:
    """The guide's Python blocks as one script, each followed by a line that says it ran to its end."""
    parts = []
    for number, block in enumerate(python_blocks(GUIDE), start=1):
        parts.append(
            f"# --- docs/spark.md, Python block {number} ---\n{block}\nprint({DONE.format(number)!r}, flush=True)\n"
        )
    return "\n".join(parts)


def test_the_guide_fences_every_block_with_its_language() -> None:
    """A block meant to run is ```python; every other one says what it is (```bash, ```properties), so the test
    below runs exactly the blocks a reader is meant to run."""
    blocks = fenced_blocks(GUIDE)
    assert [language for language, _ in blocks if not language] == []
    assert len(python_blocks(GUIDE)) >= 2, "the guide has lost its quick start"
    assert "```python\n" in GUIDE.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]


def test_sections_named_in_links_to_the_guide_and_the_architecture_exist() -> None:
    """A reference such as ``docs/spark.md, "Reading state back"`` (in docs/ and the README) names a heading of that
    file (its full title, or the start of it)."""
    headings: dict[str, list[str]] = {}
    for name in ("spark.md", "architecture.md"):
        text = (ROOT / "docs" / name).read_text()
        headings[name] = [line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{1,6} ", line)]
    stale = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = " ".join(path.read_text().split())  # a reference may be wrapped over two lines
        for name, title in re.findall(r"docs/(spark\.md|architecture\.md), \"([^\"]+)\"", text):
            if not any(heading.startswith(title) for heading in headings[name]):
                stale.append(f"{path.name}: docs/{name}, {title!r}")
        if path.name == "architecture.md":  # its own sections, referred to as "below" / "above"
            for title in re.findall(r"(?:below|above)[,:]? \"([^\"]+)\"", text):
                if not any(heading.startswith(title) for heading in headings["architecture.md"]):
                    stale.append(f"architecture.md: {title!r}")
    assert stale == []


def guide_run(folder: Path, tests: frozenset[str]) -> tuple[list[str], Path]:
    """The guide's script, run from an empty working directory of its own."""
    work = folder / "work"
    work.mkdir()
    script = work / "spark_guide.py"
    script.write_text(guide_script())
    return [str(script)], work


# in the background with the suite's other scripts (tests/script_runs.py)
register(
    "spark-guide",
    __name__,
    ["test_every_python_block_of_the_guide_runs_in_order_and_the_quick_start_counts_the_words"],
    guide_run,
)


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(1800)
def test_every_python_block_of_the_guide_runs_in_order_and_the_quick_start_counts_the_words(
    script_runs: ScriptRuns,
) -> None:
    blocks = len(python_blocks(GUIDE))
    result = script_runs.result("spark-guide")
    ran = [line for line in result.stdout.splitlines() if line.startswith("### guide block ")]
    failed = len(ran) + 1
    assert result.returncode == 0 and len(ran) == blocks, (
        f"docs/spark.md's Python block {failed} of {blocks} failed (exit {result.returncode}):\n"
        + result.stdout[-3000:]
        + result.stderr[-5000:]
    )
    assert ran == [DONE.format(number) for number in range(1, blocks + 1)]
    # the quick start prints the counts it read back from the blob store: the words of its one input file
    lines = result.stdout.splitlines()
    printed = lines[lines.index(DONE.format(1)) - 1]
    assert printed == str({"ada": 2, "bob": 2, "cy": 1})

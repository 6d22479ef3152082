"""The benchmark docs cite files that exist: every `bench/...` path in README.md,
bench/README.md and bench/results/README.md, the scripts bench/README.md indexes, and the
results folders each of the three tables names (relative to bench/results/)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = ("README.md", "bench/README.md", "bench/results/README.md")
CODE_SPAN = re.compile(r"`([^`]+)`")
BENCH_PATH = re.compile(r"(?<![\w/.])bench/[\w./{},*\-]*")
BRACES = re.compile(r"\{([^{}]*)\}")


def _expand(pattern: str) -> list[str]:
    """Gives `pattern` with each {a,b} group expanded (shell brace expansion)."""
    parts = BRACES.split(pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def _missing(base: Path, pattern: str) -> list[str]:
    """Gives the expansions of `pattern` (globs allowed) that match nothing under `base`."""
    return [p for p in _expand(pattern.rstrip(".,;:)")) if not any(base.glob(p.rstrip("/")))]


def _spans(text: str) -> list[str]:
    """Gives the code spans of markdown `text`: each fenced block whole, each `inline` span."""
    pieces = text.split("```")
    return [span for i, piece in enumerate(pieces)
            for span in ([piece] if i % 2 else CODE_SPAN.findall(piece))]


def _table_cells(text: str, header: str, column: int) -> list[str]:
    """Gives column `column` of every row of the table whose header row starts `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    cells = []
    for line in itertools.takewhile(lambda x: x.startswith("|"), lines[start + 2:]):
        cells.append(re.split(r"(?<!\\)\|", line.strip().strip("|"))[column].strip())
    return cells


def _tables(text: str, header: str, column: int) -> list[str]:
    """Gives column `column` of every table whose header row starts `header`."""
    cells: list[str] = []
    rest = text
    while header in rest:
        rest = rest[rest.index(header):]
        cells += _table_cells(rest, header, column)
        rest = rest[len(header):]
    return cells


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_bench_path_exists(doc: str) -> None:
    text = (ROOT / doc).read_text()
    cited = [path for span in _spans(text) for path in BENCH_PATH.findall(span)
             if "<" not in span]
    assert cited, f"{doc} cites no bench/ path: the pattern is wrong"
    missing = sorted({m for path in cited for m in _missing(ROOT, path)})
    assert not missing, f"{doc} cites paths that do not exist: {missing}"


def test_bench_readme_indexes_existing_scripts_and_results() -> None:
    text = (ROOT / "bench/README.md").read_text()
    scripts = [_spans(cell)[0].split()[0]
               for header in ("| wrapper |", "| script |") for cell in _tables(text, header, 0)]
    assert len(scripts) > 40
    assert not [s for s in scripts if not (ROOT / "bench" / s).is_file()]
    results = [span for header in ("| wrapper |", "| script |")
               for cell in _tables(text, header, -1) for span in _spans(cell)]
    missing = sorted({m for r in results for m in _missing(RESULTS, r)})
    assert not missing, f"bench/README.md names results that do not exist: {missing}"


def test_every_bench_script_is_indexed() -> None:
    text = (ROOT / "bench/README.md").read_text()
    scripts = {p.relative_to(ROOT / "bench").as_posix()
               for p in itertools.chain((ROOT / "bench").glob("*.py"),
                                        (ROOT / "bench").glob("*.sh"),
                                        (ROOT / "bench/kernels").glob("*.*"))}
    assert scripts
    unindexed = sorted(s for s in scripts if f"`{s}" not in text)
    assert not unindexed, f"bench/README.md does not index {unindexed}: add a row for each"


@pytest.mark.parametrize(("doc", "header", "column"), [
    ("bench/results/README.md", "| result |", 0),
    ("README.md", "| what | result |", -1),
])
def test_result_tables_name_existing_results(doc: str, header: str, column: int) -> None:
    cells = _tables((ROOT / doc).read_text(), header, column)
    named = [span for cell in cells for span in _spans(cell)]
    assert len(named) > 20
    missing = sorted({m for name in named for m in _missing(RESULTS, name)})
    assert not missing, f"{doc} names results that do not exist: {missing}"

"""Every measured number in README.md and docs/*.md names where it comes from.

A number with a unit of time, speed, ratio, share or size (``67 s``, ``6 minutes``, ``967 GFLOP/s``,
``6,065 tokens/s``, ``1.21x``, ``66.2%``, ``487 MiB``), and every number in a table column headed by such a unit
(or by perplexity or accuracy), must have a source in its line or in its paragraph: the path of a committed results
file (``benchmarks/results/...``, which records the machine and its load) or of a test (``tests/...py``, optionally
``::test_name``) that exists. A table's paragraph is the table and the paragraph just above it (its caption).
Paragraphs are separated by blank lines, so one source serves a paragraph, a list written without blank lines, or
a captioned table.

Not scanned: fenced code blocks and inline code spans (commands, config values and what a command prints, which
running it reproduces), and link targets. ``ALLOWED`` lists the few numbers that are definitions rather than
measurements (a threshold in the code, a default, the arithmetic of a size); each entry says why, and must still
occur in its file. ``PENDING`` holds text whose sources are being settled elsewhere (the planner's figures); each
entry must also still occur, so it is removed when its text changes.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

NUMBER = r"(?<![\w.,/-])\d+(?:,\d{3})*(?:\.\d+)?"
# A unit right after the number; "x" only when attached ("1.21x", "78x"), since "16 x 64" is a product.
UNIT = (r"(?:%|x(?![\w])|\s?(?:GFLOP/s|TFLOP/s|GB/s|MB/s|tokens/s|tok/s|samples/s|steps/s"
        r"|ms|s|seconds?|min|minutes?|hours?|MiB|MB|GiB|GB|KiB|KB)(?![\w/]))")
MEASURED = re.compile(NUMBER + r"(?:\s?(?:-|to)\s?\d[\d,]*(?:\.\d+)?)?" + UNIT)
# A table column whose numbers are measurements: its header names a unit, or perplexity / accuracy.
UNIT_HEADER = re.compile(r"\((?:s|ms|MiB|MB|%)\)|\b(?:ms|s|MiB|MB|GiB|GB)\b|/s\b|%|perplexity|accuracy|speed-up|vs ",
                         re.IGNORECASE)
SOURCE = re.compile(r"(?:benchmarks/results/[\w.-]+\.(?:md|json|png)|tests/[\w/.-]+?\.py(?:::\w+)?)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`]*`")  # may run over lines: the paragraph is blanked as a whole
LINK_TARGET = re.compile(r"\]\([^)\n]*\)")

# (file, exact text): why the number in it is a definition, not a measurement.
ALLOWED = {
    ("README.md", "at least 1.25x faster"): "the threshold of dufu/engine/precision.py (MIN_SPEEDUP), a definition",
    ("docs/faults.md", "(default 5 s)"): "the default of `dufu lighthouse --heartbeat-timeout`, a setting",
}

# (file, exact text): figures whose sources another change settles (the planner's); they are not checked here.
PENDING: dict = {}
PENDING_FILES: dict = {}


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def _blocks(path: Path) -> list[list[tuple[int, str]]]:
    """The file's paragraphs outside fenced code: lists of (line number, line), split at blank lines and where a
    table starts or ends."""
    blocks, current, in_fence = [], [], False

    def flush():
        if current:
            blocks.append(list(current))
            current.clear()

    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            flush()
            continue
        if in_fence or not line.strip():
            flush()
            continue
        if current and line.lstrip().startswith("|") != current[-1][1].lstrip().startswith("|"):
            flush()
        current.append((number, line))
    flush()
    return blocks


def _is_table(block) -> bool:
    return block[0][1].lstrip().startswith("|")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _blank(match: re.Match) -> str:
    return re.sub(r"[^\n]", " ", match.group(0))


def _scannable(block, rel: str) -> list[str]:
    """The block's lines without allowlisted text, code spans (which may run over lines) and link targets."""
    lines = [line for _, line in block]
    for (file, allowed) in (*ALLOWED, *PENDING):
        if file == rel:
            lines = [line.replace(allowed, " " * len(allowed)) for line in lines]
    text = LINK_TARGET.sub(_blank, CODE_SPAN.sub(_blank, "\n".join(lines)))
    return text.split("\n")


def _measured_lines(block, rel: str) -> list[tuple[int, str, list[str]]]:
    """(line number, line, the measured numbers in it) for the lines of a block that hold measurements."""
    found = []
    unit_columns: set[int] = set()
    if _is_table(block):
        header = _cells(block[0][1])
        unit_columns = {i for i, cell in enumerate(header) if UNIT_HEADER.search(CODE_SPAN.sub(" ", cell))}
    for row, ((number, line), text) in enumerate(zip(block, _scannable(block, rel))):
        hits = [m.group(0) for m in MEASURED.finditer(text)]
        if _is_table(block) and row >= 2:  # below the header and the |---| line
            for i, cell in enumerate(_cells(text)):
                if i in unit_columns and re.search(r"\d", cell):
                    hits.append(cell)
        if hits:
            found.append((number, line, hits))
    return found


def _unsourced(path: Path) -> list[str]:
    rel = _rel(path)
    blocks = _blocks(path)
    problems = []
    for index, block in enumerate(blocks):
        paragraph = [line for _, line in block]
        if _is_table(block) and index > 0 and not _is_table(blocks[index - 1]):
            paragraph += [line for _, line in blocks[index - 1]]  # the caption above the table
        if any(SOURCE.search(line) for line in paragraph):
            continue
        for number, line, hits in _measured_lines(block, rel):
            problems.append(f"{rel}:{number}: {', '.join(hits)}  <-  {line.strip()[:120]}")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_every_measured_number_names_its_source(path):
    if _rel(path) in PENDING_FILES:
        pytest.skip(f"{_rel(path)}: {PENDING_FILES[_rel(path)]} are settled by another change")
    problems = _unsourced(path)
    assert not problems, (
        "These numbers name no source in their line or paragraph. Write the results file "
        "(benchmarks/results/NAME-DATE.md, from the benchmark's own output) or the test (tests/...py::test_name) "
        "that measured them next to them, rephrase without the number, or -- for a definition, not a "
        "measurement -- add it to ALLOWED in tests/test_docs_numbers.py with the reason:\n" + "\n".join(problems))


def test_every_cited_source_exists():
    missing = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for source in SOURCE.findall(line):
                file, _, test = source.partition("::")
                target = ROOT / file
                if not target.is_file():
                    missing.append(f"{_rel(path)}:{number}: {file} does not exist")
                elif test and not re.search(rf"^\s*(?:async\s+)?def {re.escape(test)}\b", target.read_text(), re.M):
                    missing.append(f"{_rel(path)}:{number}: {file} has no test {test}")
    assert not missing, "Sources that are not in the repository:\n" + "\n".join(missing)


@pytest.mark.parametrize("table", ["ALLOWED", "PENDING"])
def test_allowlisted_text_still_occurs(table):
    entries = ALLOWED if table == "ALLOWED" else PENDING
    stale = [f"{file}: {text!r}" for (file, text) in entries if text not in (ROOT / file).read_text()]
    assert not stale, f"{table} entries whose text is gone (remove them from tests/test_docs_numbers.py):\n" + \
        "\n".join(stale)


def _literal_length(path: Path, name: str) -> int:
    """len() of the list or dict literal assigned to ``name`` at the top of a Python file, read without importing."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            if isinstance(node.value, ast.Dict):
                return len(node.value.keys)
            if isinstance(node.value, ast.List):
                return len(node.value.elts)
    raise AssertionError(f"{_rel(path)} has no list or dict literal {name}")


WORDS = {"four": 4, "ten": 10, "sixteen": 16}
# (doc, the count as the doc writes it, with the number as group 1; the file whose literal it counts; the literal)
COUNTS = [
    ("docs/parallelism.md", r"once in each of (\d+) layouts", "tests/parallel/test_loss_parity.py", "LAYOUTS"),
    ("README.md", r"benchmarks/parallel.py +# (\w+) layouts", "benchmarks/parallel.py", "LAYOUTS"),
    ("README.md", r"--quick +# smoke run: (\w+) layouts", "benchmarks/parallel.py", "QUICK_LAYOUTS"),
]


@pytest.mark.parametrize("doc,pattern,source,name", COUNTS, ids=[f"{d}:{n}" for d, _, _, n in COUNTS])
def test_counted_layouts_match_the_lists_they_count(doc, pattern, source, name):
    m = re.search(pattern, (ROOT / doc).read_text())
    assert m, f"{doc} no longer says {pattern!r}: update COUNTS in tests/test_docs_numbers.py"
    said = int(m.group(1)) if m.group(1).isdigit() else WORDS[m.group(1)]
    actual = _literal_length(ROOT / source, name)
    assert said == actual, f"{doc} says {m.group(0)!r}, but {source} has {actual} entries in {name}"


def test_the_scan_finds_an_unsourced_number(tmp_path):
    """The check itself: a measurement without a source is reported, the same with a source in its paragraph or
    in a table's caption is not, and numbers in code (spans, also over two lines, and blocks) and products are not
    measurements."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "The main job takes 67 s on two cores,\nand 1.21x the other.\n\n"
        "It takes 66.6 s (benchmarks/results/default_run-2026-11-25.md).\n\n"
        "Run `dufu train --max-memory 2GB`; a batch of 16 x 64 tokens; `dufu generate --max-memory\n2GB`.\n\n"
        "| layout | tokens/s |\n|---|---|\n| dp2 | 2,151 |\n\n"
        "Caption: benchmarks/results/parallel-2026-11-21.md\n\n| layout | ms/step |\n|---|---|\n| dp2 | 476 |\n\n"
        "```\n$ dufu train\n12 s\n```\n")
    problems = _unsourced(doc)
    assert [p.split(":")[1] for p in problems] == ["1", "2", "11"], problems
    assert "67 s" in problems[0] and "1.21x" in problems[1] and "2,151" in problems[2]

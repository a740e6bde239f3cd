"""Prose says what is true now: no dated readings or history markers in README.md, BENCHMARKS.md, the docs site
(``docs/**/*.md``) or the comments and docstrings of ``kvcomp/**/*.py``, and the README and BENCHMARKS.md stay short.

A marker is an ISO date (``YYYY-MM-DD``; a year alone or a year and month is a name, not a date), the word "today",
an issue number ("issue 38", "issue #38"), a device-time budget ("s of device time", ``budget_left``, "lease") or a
path outside the repository (``/work/``, ``/tmp/``, ``/root/``). In ``kvcomp`` a commit id or a numbered entry of
BENCHMARKS.md is one too. Python files are read for their comments (:mod:`tokenize`) and docstrings (:mod:`ast`:
every bare string statement) only: string literals that are data or error messages are not prose. ``ALLOWED`` lists
the exceptions, each with its reason. ``pytest tests/usage/test_prose.py -k kvcomp`` checks the code alone.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200
BENCHMARKS_MAX_BYTES = 40_000

MARKERS = {
    "ISO date": re.compile(r"(?<!\d)\d{4}-[01]\d-[0-3]\d(?!\d)"),
    "'today'": re.compile(r"\btoday\b", re.IGNORECASE),
    "issue number": re.compile(r"\bissues? ?#?\d+", re.IGNORECASE),
    "device-time budget": re.compile(r"\bs of device time\b|\bbudget_left|\blease\b", re.IGNORECASE),
    "path outside the repository": re.compile(r"(?<![\w.~-])/(?:work|tmp|root)/"),
}
CODE_MARKERS = {  # kvcomp's comments and docstrings only (BENCHMARKS.md names the revision each table ran at)
    "commit id": re.compile(r"\b(?!0[bx])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
    "BENCHMARKS entry number": re.compile(
        r"\b(?:entry|entries) (?:no\.? ?)?\d+\b|\b(?:\w+teenth|\w*tieth|first|second|third|fourth|fifth|sixth|seventh"
        r"|eighth|ninth|tenth|eleventh|twelfth)[\w-]*(?: (?:and|or) \w+)?(?: static-model)? entr(?:y|ies)\b",
        re.IGNORECASE),
}
# (file relative to the repository, text of the hit): why it is not a dated reading. Keep this short.
ALLOWED: dict[tuple[str, str], str] = {}


def _python_prose(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and every line of a docstring (any bare string statement) of ``path``."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    prose = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            prose += [(n, lines[n - 1]) for n in range(node.lineno, node.end_lineno + 1)]
    return sorted(prose)


def _markdown_prose(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text(encoding="utf-8").splitlines(), start=1))


def _hits(paths: list[Path], read, markers: dict) -> list[str]:
    found = []
    for path in paths:
        name = path.relative_to(ROOT).as_posix()
        if not any(pattern.search(path.read_text(encoding="utf-8")) for pattern in markers.values()):
            continue  # nothing anywhere in the file: no need to tell its prose from its code
        for line, text in read(path):
            for marker, pattern in markers.items():
                for match in pattern.finditer(text):
                    if (name, match.group(0)) not in ALLOWED:
                        found.append(f"{name}:{line}: {marker} {match.group(0)!r}: {text.strip()[:160]}")
    return found


GROUPS = {
    "README": (lambda: [ROOT / "README.md"], _markdown_prose, MARKERS),
    "BENCHMARKS": (lambda: [ROOT / "BENCHMARKS.md"], _markdown_prose, MARKERS),
    "docs": (lambda: sorted((ROOT / "docs").rglob("*.md")), _markdown_prose, MARKERS),
    "kvcomp": (lambda: sorted((ROOT / "kvcomp").rglob("*.py")), _python_prose, {**MARKERS, **CODE_MARKERS}),
}


@pytest.mark.parametrize("group", list(GROUPS))
def test_prose_has_no_dated_readings_or_history_markers(group):
    files, read, markers = GROUPS[group]
    paths = [p for p in files() if p.is_file()]
    hits = _hits(paths, read, markers)
    assert not hits, (f"{len(hits)} dated reading(s) or history marker(s) in {group} (state what is true now; git "
                      "keeps the history; a real exception goes in tests/usage/test_prose.py's ALLOWED with its reason):\n"
                      + "\n".join(hits))


def test_the_allowed_exceptions_are_still_needed():
    """Every entry of ``ALLOWED`` still matches a marker in its file (a stale exception is removed)."""
    markers = {**MARKERS, **CODE_MARKERS}
    for name, text in ALLOWED:
        path = ROOT / name
        read = _python_prose if path.suffix == ".py" else _markdown_prose
        assert path.is_file() and any(match.group(0) == text for _, line in read(path)
                                      for pattern in markers.values() for match in pattern.finditer(line)), (
            f"ALLOWED[({name!r}, {text!r})] matches nothing there any more: remove it")


@pytest.mark.parametrize(("text", "marker"), [
    ("on the machine of 2026-12-02", "ISO date"), ("stamped 2019-04-25T12:57:54Z", "ISO date"),
    ("today's kernels", "'today'"), ("(issue 20)", "issue number"), ("issue #38", "issue number"),
    ("662 of 900 s of device time", "device-time budget"), ("in the second lease", "device-time budget"),
    ("budget_left_s", "device-time budget"), ("see /work/shared/x", "path outside the repository"),
    ("written to /tmp/site", "path outside the repository"), ("0.608 ms of device time", None),
    ("GPU leases of parallel members", None), ("lease_gpu()", None), ("the 2026 baselines", None),
    ("arXiv 2410.21465", None), ("cc_2019-30", None), ("scripts/tmp/x", None),
])
def test_the_markers_find_dated_prose_and_leave_names_alone(text, marker):
    found = [name for name, pattern in MARKERS.items() if pattern.search(text)]
    assert found == ([marker] if marker else [])


@pytest.mark.parametrize(("text", "found"), [
    ("measured at 9c57ff6", True), ("BENCHMARKS.md's eighteenth entry", True),
    ("the nineteenth static-model entry", True), ("BENCHMARKS.md's nineteenth and twentieth entries", True),
    ("BENCHMARKS.md entry 12", True),
    ("one entry per codec", False), ("1048576 vectors", False), ("the decade", False), ("0b00111001", False),
])
def test_the_code_markers_find_commits_and_entry_numbers(text, found):
    assert any(pattern.search(text) for pattern in CODE_MARKERS.values()) == found


def test_python_prose_is_comments_and_docstrings_only(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('"""Module doc."""\nX = "2026-01-01"  # a comment\n\n\ndef f():\n    """Doc\n    line two."""\n'
                      '    return "/tmp/x"\n\n\nY = 1\n"""Attribute doc."""\n')
    assert _python_prose(source) == [(1, '"""Module doc."""'), (2, "# a comment"), (6, '    """Doc'),
                                     (7, '    line two."""'), (12, '"""Attribute doc."""')]


def test_the_readme_is_read_in_five_minutes():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}: the rest goes to "
                                       "docs/)")


def test_benchmarks_holds_current_numbers_only():
    size = (ROOT / "BENCHMARKS.md").stat().st_size
    assert size <= BENCHMARKS_MAX_BYTES, (f"BENCHMARKS.md is {size:,} bytes (at most {BENCHMARKS_MAX_BYTES:,}: one "
                                          "current table per benchmark; git keeps the earlier readings)")

"""The documentation stays true to the tree: README.md and docs/ (pure file reading, no torch).

* README.md is a front door of at most 200 lines whose Layout section names every module of
  common/, plexus/ and llm/, and every path it names exists.
* Code cites design documents only as existing ``docs/...md`` files (and the sections it cites
  exist); README.md is the one bare name allowed.
* Every relative link, bench script, ``python -m`` module and repository path the docs name
  exists.
* Every table of docs/benchmarks.md carries its provenance on the line before it:
  ``Measured: date=...; commit=...; machine=...; command=...`` (``Predicted:`` for outputs of
  the performance model), a field that was not recorded saying ``not recorded``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PACKAGES = ("common", "plexus", "llm")
CODE_DIRS = (*PACKAGES, "bench", "datasets")
REPO_DIRS = (*PACKAGES, "bench", "datasets", "tests", "docs")
MAX_README_LINES = 200

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MD_MENTION = re.compile(r"[\w./-]*\.md\b")
SECTION_CITE = re.compile(r"(docs/[\w./-]+\.md),?\s+sections?\s+((?:\d+(?:\s*(?:-|,|and)\s*)?)+)")
MODULE_RUN = re.compile(r"python\s+-m\s+([\w.]+)")
BENCH_RUN = re.compile(r"\b(bench/\w+\.py)\b")
PROVENANCE = re.compile(
    r"^(Measured|Predicted): date=(\d{4}-\d{2}-\d{2}|not recorded); "
    r"commit=([0-9a-f]{7,40}|not recorded); machine=([^;]+); command=(.+)$")


def _doc_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _without_fences(text: str) -> str:
    return FENCE.sub("", text)


def _section(text: str, title: str) -> str:
    """The body of the ``## title`` section of a markdown text."""
    match = re.search(rf"^## {re.escape(title)}[ \t]*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match is not None, f"no '## {title}' section"
    return match.group(1)


def _modules() -> list[str]:
    """Every module of the packages as the README names it: ``pkg/mod.py``, or ``pkg/sub/``
    for a package's ``__init__.py``."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "__pycache__" in rel.parts:
                continue
            out.append(f"{rel.parent.as_posix()}/" if rel.name == "__init__.py"
                       else rel.as_posix())
    return out


def _exists(rel: str) -> bool:
    return (ROOT / rel.rstrip("/")).exists()


def test_readme_is_at_most_200_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; at most {MAX_README_LINES}"


def test_readme_layout_names_every_module():
    layout = _section(README.read_text(), "Layout")
    named = set(INLINE.findall(layout))
    missing = [m for m in _modules() if m not in named]
    assert not missing, f"README.md's Layout section does not name: {missing}"


def test_every_path_the_readme_names_exists():
    text = _without_fences(README.read_text())
    paths = [p for p in INLINE.findall(text) if " " not in p and p.endswith((".py", "/"))]
    paths += [t for t in LINK.findall(text) if t.startswith("docs/")]
    missing = sorted({p for p in paths if not _exists(p.split("#")[0])})
    assert not missing, f"README.md names paths that do not exist: {missing}"


def _code_files() -> list[Path]:
    return [p for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*.py"))
            if "__pycache__" not in p.parts]


def test_code_cites_design_documents_only_inside_docs():
    """Every ``x.md`` the code mentions is an existing ``docs/...md`` (README.md allowed)."""
    bad = []
    for path in _code_files():
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for name in MD_MENTION.findall(line):
                ok = (name == "README.md"
                      or (name.endswith("/README.md") and _exists(name))
                      or (name.startswith("docs/") and _exists(name)))
                if not ok:
                    bad.append(f"{path.relative_to(ROOT)}:{lineno}: {name}")
    assert not bad, ("cite design documents as existing docs/...md paths:\n"
                     + "\n".join(bad))


def _numbers(spec: str) -> set[int]:
    out: set[int] = set()
    for part in re.split(r"\s*(?:,|and)\s*", spec.strip()):
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-") if x.strip())
            out.update(range(lo, hi + 1))
        elif part.strip():
            out.add(int(part))
    return out


def test_cited_sections_exist():
    """``docs/design/plexus-3d.md sections 1-4`` in the code: the doc has ``## 1.`` .. ``## 4.``."""
    bad = []
    for path in _code_files():
        text = " ".join(path.read_text().split())  # citations may wrap lines
        for doc, spec in SECTION_CITE.findall(text):
            if not _exists(doc):
                continue  # reported by test_code_cites_design_documents_only_inside_docs
            headings = (ROOT / doc).read_text()
            bad += [f"{path.relative_to(ROOT)}: {doc} section {n}" for n in _numbers(spec)
                    if not re.search(rf"^## {n}\. ", headings, re.M)]
    assert not bad, "cited sections that do not exist:\n" + "\n".join(bad)


def test_every_relative_link_exists():
    bad = []
    for doc in _doc_files():
        for target in LINK.findall(_without_fences(doc.read_text())):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            if not (doc.parent / target.split("#")[0]).exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not bad, "links to files that do not exist:\n" + "\n".join(bad)


def test_every_repository_path_in_the_docs_exists():
    """Backticked paths under the repository's folders, ``bench/*.py`` scripts and
    ``python -m`` modules of this repository, in the README and docs/."""
    bad = []
    for doc in _doc_files():
        text = doc.read_text()
        names = [p for p in INLINE.findall(_without_fences(text))
                 if " " not in p and p.split("/")[0] in REPO_DIRS and p.endswith((".py", "/"))]
        names += BENCH_RUN.findall(text)
        bad += [f"{doc.relative_to(ROOT)}: {p}" for p in sorted(set(names)) if not _exists(p)]
        for module in sorted(set(MODULE_RUN.findall(text))):
            if module.split(".")[0] not in PACKAGES:
                continue
            rel = module.replace(".", "/")
            if not (_exists(f"{rel}.py") or _exists(f"{rel}/__main__.py")):
                bad.append(f"{doc.relative_to(ROOT)}: python -m {module}")
    assert not bad, "the docs name paths that do not exist:\n" + "\n".join(bad)


def _tables(text: str) -> list[tuple[int, list[str]]]:
    """(index of the header line, all lines) of every markdown table outside code fences."""
    lines = _without_fences(text).splitlines()
    return [(i, lines) for i, line in enumerate(lines)
            if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))]


def test_benchmark_tables_carry_their_provenance():
    tables = _tables((DOCS / "benchmarks.md").read_text())
    assert tables, "docs/benchmarks.md has no tables"
    bad = []
    for i, lines in tables:
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        if not PROVENANCE.match(before):
            bad.append(f"table at line {i + 1} ({lines[i][:40]}...): line before is {before!r}")
    assert not bad, ("each table needs 'Measured: date=...; commit=...; machine=...; "
                     "command=...' on the line before it:\n" + "\n".join(bad))


@pytest.mark.parametrize("line", [
    "Measured: date=2026-11-24; commit=44d5463; machine=2 cores; command=`python bench/x.py`",
    "Predicted: date=not recorded; commit=not recorded; machine=none; command=not recorded",
])
def test_provenance_convention_accepts(line):
    assert PROVENANCE.match(line)


@pytest.mark.parametrize("line", [
    "Measured: date=2026-11-24; commit=44d5463; command=`python bench/x.py`",  # no machine
    "Measured: date=yesterday; commit=44d5463; machine=vm; command=x",
    "Measured on this machine",
])
def test_provenance_convention_refuses(line):
    assert not PROVENANCE.match(line)

"""Comments, docstrings and documents speak of the software: what it does and why.
Measurements live in docs/benchmarks.md, each with a provenance line that names the kind of
machine; the phrases of :data:`FORBIDDEN` point instead at where or when a piece was written,
or at code that is not part of the repository, and fail the check (with ``file:line`` of each
hit)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("common", "plexus", "llm", "bench", "datasets", "tests")
FORBIDDEN = re.compile("|".join(re.escape(p) for p in (
    "development machine", "this session", "in a session", "probe script",
    "not in the repository")), re.IGNORECASE)
# documents still being reworded; each leaves this list once it passes
DOCS_PENDING: tuple[str, ...] = ()
THIS = Path(__file__).resolve()


def hits(paths: list[Path], root: Path = ROOT) -> list[str]:
    """``path:line: text`` (relative to ``root``) of every line of ``paths`` that matches
    :data:`FORBIDDEN`."""
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if FORBIDDEN.search(line):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()[:120]}")
    return found


def code_files() -> list[Path]:
    return sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py")
                  if p.resolve() != THIS)


def doc_files() -> list[Path]:
    readme = ROOT / "README.md"
    return sorted((ROOT / "docs").rglob("*.md")) + ([readme] if readme.exists() else [])


def test_no_code_comment_or_docstring_names_the_development_setting():
    found = hits(code_files())
    assert not found, ("say why the code is as it is, not where or when it was written "
                       "(measurements: docs/benchmarks.md):\n" + "\n".join(found))


def test_no_document_names_the_development_setting():
    checked = [p for p in doc_files() if p.relative_to(ROOT).as_posix() not in DOCS_PENDING]
    found = hits(checked)
    assert not found, ("name the kind of machine, not where or when a text was written:\n"
                       + "\n".join(found))


def test_pending_documents_are_still_pending():
    done = [name for name in DOCS_PENDING
            if (ROOT / name).exists() and not hits([ROOT / name])]
    assert not done, f"these pass now; remove them from DOCS_PENDING: {done}"


def test_the_check_finds_each_phrase_in_any_case(tmp_path):
    text = tmp_path / "x.py"
    text.write_text("ok\n# On the Development Machine\n# fine\n# a Probe Script, NOT IN THE "
                    "REPOSITORY\n# this session; in a session\n")
    assert [h.split(": ")[0] for h in hits([text], tmp_path)] == ["x.py:2", "x.py:4", "x.py:5"]

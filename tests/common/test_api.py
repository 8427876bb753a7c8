"""docs/api.md, the public API of common/, stays true to the code: every name it lists imports
from the module it is listed under, every public name of a stable module is listed (its
``__all__`` where it has one; else the functions, classes and UPPER_CASE constants it defines),
and every module of common/ is listed once, as stable or internal."""

from __future__ import annotations

import ast
import importlib
import re

from tests.distributed import ROOT

API = ROOT / "docs" / "api.md"
HEADING = re.compile(r"^### `([\w.]+)`$", re.M)
ITEM = re.compile(r"^- `([\w.]+)`:", re.M)


def _section(title: str) -> str:
    text = API.read_text()
    match = re.search(rf"^## {re.escape(title)}$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match is not None, f"docs/api.md has no '## {title}' section"
    return match.group(1)


def _stable() -> dict[str, list[str]]:
    """Module -> the names docs/api.md lists under it."""
    parts = HEADING.split(_section("Stable modules"))  # ["", module, body, module, body, ...]
    return {module: ITEM.findall(body) for module, body in zip(parts[1::2], parts[2::2])}


def _internal() -> list[str]:
    return ITEM.findall(_section("Internal modules"))


def _modules_of_common() -> list[str]:
    """Every module of common/ by its dotted name (``__main__`` files run a package's command
    and are not imported)."""
    out = []
    for path in sorted((ROOT / "common").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _public_names(module: str) -> set[str]:
    """The module's ``__all__``, or the names it defines that a user would import."""
    mod = importlib.import_module(module)
    if hasattr(mod, "__all__"):
        return set(mod.__all__)
    names = set()
    for node in ast.parse(open(mod.__file__).read()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        names.update(t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper())
    return {n for n in names if not n.startswith("_")}


def test_every_listed_name_imports_from_its_module():
    stable = _stable()
    assert "common" in stable and "common.grid" in stable and "common.perf" in stable
    missing = [f"{module}.{name}" for module, names in stable.items() for name in names
               if not hasattr(importlib.import_module(module), name)]
    assert not missing, f"docs/api.md lists names that do not import: {missing}"
    twice = [f"{m}.{n}" for m, names in stable.items() for n in set(names)
             if names.count(n) > 1]
    assert not twice, twice


def test_every_public_name_of_a_stable_module_is_listed():
    unlisted = {module: sorted(_public_names(module) - set(names))
                for module, names in _stable().items()}
    unlisted = {m: n for m, n in unlisted.items() if n}
    assert not unlisted, f"public names that docs/api.md does not list: {unlisted}"


def test_every_module_of_common_is_listed_once():
    stable, internal = list(_stable()), _internal()
    listed = stable + internal
    modules = _modules_of_common()
    assert not sorted(set(modules) - set(listed)), "modules docs/api.md does not list"
    assert not sorted(set(listed) - set(modules)), "docs/api.md lists modules that do not exist"
    assert len(listed) == len(set(listed)), "a module listed twice"


def test_the_index_links_the_api():
    assert "(api.md)" in (ROOT / "docs" / "index.md").read_text()

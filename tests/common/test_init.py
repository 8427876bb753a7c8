"""The package as a whole: common/ imports no engine, and its light modules load no torch."""

import ast
import subprocess
import sys

from tests.distributed import ROOT, launch_env


def test_common_imports_neither_plexus_nor_llm():
    offenders = []
    for path in sorted((ROOT / "common").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                          if n.split(".")[0] in ("plexus", "llm")]
    assert not offenders, offenders


def test_lazy_names_and_no_torch_at_import():
    code = ("import sys, common; assert 'torch' not in sys.modules; "
            "from common import init_distributed, DistContext, shutdown, fail_all_ranks; "
            "assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env=launch_env(), timeout=60)

"""datasets/ogb/prepare.py: caches a present dataset, explains a missing one."""

import subprocess
import sys
from pathlib import Path

from tests.plexus.data.ogb_format import write_arxiv_like

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "datasets" / "ogb" / "prepare.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


def test_prepare_present_and_missing(tmp_path):
    write_arxiv_like(tmp_path, num_nodes=100)
    r = _run("--name", "ogbn-arxiv", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ogbn_arxiv" / "processed" / "data_processed").exists()
    r = _run("--name", "ogbn-products", "--root", str(tmp_path))
    assert r.returncode == 2 and "ogbn_products" in r.stderr and "raw/edge.csv.gz" in r.stderr


def test_datasets_folder_is_not_a_package():
    assert not (ROOT / "datasets" / "__init__.py").exists()

"""datasets/ogb/prepare.py: caches a dataset plexus loads whole, only checks the raw files of
one plexus prepares into blocks, explains a missing one."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.plexus.data.ogb_format import (
    write_arxiv_like,
    write_papers100m_like,
    write_products_like,
)

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
    assert "--download" in r.stderr


@pytest.mark.parametrize("name,write", [("ogbn-products", write_products_like),
                                        ("ogbn-papers100M", write_papers100m_like)])
def test_datasets_plexus_prepares_are_only_checked(tmp_path, name, write):
    """plexus.train prepares these from the raw files (plexus.data.cache): no ogb cache is
    built, nothing is loaded whole, and the output says where the blocks will go."""
    write(tmp_path, num_nodes=120)
    r = _run("--name", name, "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "raw files in place" in out and "120 nodes" in out and "No cache built" in out
    assert f"plexus.train prepares {name} from these raw files into {tmp_path / 'prepared'}" \
        in out
    assert not (tmp_path / name.replace("-", "_") / "processed").exists()
    (tmp_path / name.replace("-", "_") / "split" / ("sales_ranking" if "products" in name
                                                    else "time") / "test.csv.gz").unlink()
    r = _run("--name", name, "--root", str(tmp_path))
    assert r.returncode == 2 and "test.csv.gz" in r.stderr and "--download" in r.stderr


def test_the_missing_data_message_names_the_flag_and_the_api(tmp_path):
    from plexus.data import DatasetNotFoundError, load_dataset

    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("ogbn-arxiv", tmp_path)
    msg = " ".join(str(info.value).split())
    assert (f"python datasets/ogb/prepare.py --name ogbn-arxiv --root {tmp_path} --download"
            in msg)
    assert f"load_dataset('ogbn-arxiv', {str(tmp_path)!r}, download=True)" in msg


def test_datasets_folder_is_not_a_package():
    assert not (ROOT / "datasets" / "__init__.py").exists()

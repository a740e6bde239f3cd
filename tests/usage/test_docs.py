"""The documentation cannot rot: the site builds with ``mkdocs build --strict`` (no broken link, no page missing from
the navigation, every API reference resolved), and every Python block of the README and of the pages that show code
a user runs executes as written, each page's blocks in order in one fresh interpreter."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run_py import THREADS

ROOT = Path(__file__).resolve().parents[2]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# pages whose Python blocks run on tiny random models (no embedded assets needed)
PAGES = sorted((ROOT / "docs" / "extending").glob("*.md"))
# pages whose Python blocks load the embedded SmolLM2 (scripts/setup.sh fetches it)
EMBEDDED_PAGES = [ROOT / "README.md", ROOT / "docs" / "usage" / "python-api.md"]


def python_blocks(page: Path) -> list[str]:
    return PYTHON_BLOCK.findall(page.read_text(encoding="utf-8"))


def run_blocks(page: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """Every Python block of ``page`` in order, as one script run from a scratch folder (the repository on the path,
    the Triton interpreter on: a kernel example runs on the CPU; one thread beside the other pytest workers)."""
    blocks = python_blocks(page)
    assert blocks, f"{page.relative_to(ROOT)} shows no Python block"
    script = tmp_path / f"{page.stem}.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": THREADS}
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_the_block_finder_finds_python_blocks_only(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\nx = 1\n```\n```bash\nls\n```\n    ```python\n    y = 2\n    ```\n```python\nz = 3\n```\n")
    assert python_blocks(page) == ["x = 1\n", "z = 3\n"]  # indented blocks belong to a list item's prose


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_every_python_block_of_an_extending_page_runs(page, tmp_path):
    if "import triton" in page.read_text(encoding="utf-8"):
        pytest.importorskip("triton")  # the kernel-format example (the triton extra may not install)
    done = run_blocks(page, tmp_path)
    assert done.returncode == 0, f"{page.relative_to(ROOT)}'s Python blocks failed:\n{done.stderr[-4000:]}"


@pytest.mark.integration
@pytest.mark.parametrize("page", EMBEDDED_PAGES, ids=lambda p: p.stem)
def test_every_python_block_on_the_embedded_model_runs(page, tmp_path):
    from kvcomp.data.assets import embedded_assets_ready

    if not embedded_assets_ready():
        pytest.skip("embedded assets not fetched (run scripts/setup.sh)")
    done = run_blocks(page, tmp_path)
    assert done.returncode == 0, f"{page.relative_to(ROOT)}'s Python blocks failed:\n{done.stderr[-4000:]}"


def test_the_docs_site_builds_strictly(tmp_path):
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("mkdocs is not installed: scripts/setup.sh installs the docs extra (pip install -e '.[docs]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    assert (tmp_path / "site" / "index.html").is_file()
    reference = (tmp_path / "site" / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "compressed_cache" in reference and "load_codec" in reference  # mkdocstrings rendered the docstrings
    assert ":class:" not in reference and ":func:" not in reference  # Sphinx roles shown as code (docs/hooks)


def test_sphinx_roles_become_code_spans():
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        from sphinx_roles import markdown_roles
    finally:
        sys.path.pop(0)
    text = "a :class:`~kvcomp.cache.CompressedCache`, :func:`kvcomp.api.run` and :doc:`the protocols <protocols>`"
    assert markdown_roles(text) == "a `CompressedCache`, `kvcomp.api.run` and `the protocols`"

"""The documentation site builds with mkdocs-material and mkdocstrings, in strict mode."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]  # tests/<folder>/this file


def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Every page in docs/ was built (strict mode also fails on pages left out of the nav).
    for page in (ROOT / "docs").glob("*.md"):
        built = site / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.exists(), page.name
    # The API reference is generated from the docstrings, not written by hand.
    api = (site / "api" / "index.html").read_text()
    for text in (
        "Wrap an Optax transformation so it takes gradients of a",
        "jamp.GradScaler",
        "jamp.autocast",
        "jamp.dynamic_loss_scale",
    ):
        assert text in api, text
    # The benchmarks page includes benchmarks/RESULTS.md.
    results_title = (ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()[0].lstrip("# ")
    assert results_title in (site / "benchmarks" / "index.html").read_text()


def test_every_docs_page_is_linked_from_the_index():
    index = (ROOT / "docs" / "index.md").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        if page.name != "index.md":
            assert f"({page.name})" in index, page.name

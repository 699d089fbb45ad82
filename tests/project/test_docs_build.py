"""The documentation site builds with mkdocs-material and mkdocstrings, in strict mode."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]  # tests/<folder>/this file
SOURCES = sorted((ROOT / "jamp").rglob("*.py"))
# A Sphinx role (":func:`x`"): mkdocstrings does not resolve it, so it renders as literal text.
SPHINX_ROLE = re.compile(r":(?:func|class|meth|data|attr|mod|obj|exc|any|ref):(?:`|<code>)")
# An autorefs cross-reference in a docstring: [`shown`][jamp.x] or [`jamp.x`][].
REFERENCE = re.compile(r"\[`([^`\]]+)`\]\[([^\]\s]*)\]")
# Code, left out when looking for unresolved references (an example may index ``x[0][1]``).
CODE_BLOCKS = re.compile(r"<pre.*?</pre>|<code.*?</code>|<script.*?</script>", re.S)


def references():
    """Every ``(file:line, identifier)`` that jamp's sources cross-reference."""
    for path in SOURCES:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for shown, target in REFERENCE.findall(line):
                yield f"{path.relative_to(ROOT)}:{i}", target or shown


def test_docstrings_use_cross_references_not_sphinx_roles():
    roles = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for path in SOURCES
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if SPHINX_ROLE.search(line)
    ]
    assert not roles, "write [`name`][jamp.name] (or ``name`` for a private one):\n" + "\n".join(
        roles
    )
    assert len(list(references())) > 100  # the check below sees the references


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
    # Every cross-reference resolved: strict mode fails on a target autorefs cannot find, and
    # no page shows one as text: a Sphinx role (":func:<code>x</code>"), or outside code the
    # "[<code>x</code>][jamp.x]" of an identifier autorefs did not take.
    for html in site.rglob("*.html"):
        page = html.read_text()
        for leftover, text in (
            (SPHINX_ROLE, page),
            (re.compile(r"\]\[|<autoref"), CODE_BLOCKS.sub("", page)),
        ):
            found = leftover.search(text)
            context = text[max(0, found.start() - 80) : found.end() + 80] if found else ""
            assert found is None, f"{html.relative_to(site)}: {context!r}"
    assert api.count('class="autorefs autorefs-internal"') > 100
    # Each target named in jamp/ (a private helper's docstring too, never rendered) is an
    # object the API page documents.
    missing = [(where, target) for where, target in references() if f'id="{target}"' not in api]
    assert not missing, missing
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

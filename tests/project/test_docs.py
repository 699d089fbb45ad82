"""Every code block of README.md and docs/, and every docstring example, runs."""

import doctest
import importlib
import pathlib
import pkgutil
import re

import pytest

import jamp._src

ROOT = pathlib.Path(__file__).resolve().parents[2]  # tests/<folder>/this file
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks():
    for path in DOCS:
        for i, match in enumerate(BLOCK.finditer(path.read_text())):
            yield pytest.param(match.group(1), id=f"{path.relative_to(ROOT)}#{i}")


def test_docs_exist_and_have_code():
    assert (ROOT / "docs" / "index.md").exists()
    assert len(list(blocks())) >= 8


@pytest.mark.standard_promotion  # docs use optax.adamw, whose bias correction strict mode rejects
@pytest.mark.parametrize("code", list(blocks()))
def test_code_block_runs(code):
    exec(compile(code, "<doc>", "exec"), {"__name__": "__doc__"})


def test_readme_commands():
    text = (ROOT / "README.md").read_text()
    lines = [line.strip() for line in text.splitlines()]
    assert 'pip install -e ".[examples]" && python examples/train_digits.py' in lines
    assert 'pip install -e ".[test]" && pytest' in lines


# Every module of jamp's, public functions' examples included.
MODULES = sorted(
    m.name for m in pkgutil.walk_packages(jamp._src.__path__, "jamp._src.") if not m.ispkg
)
# The modules whose docstrings must carry examples: those defining public functions.
WITH_EXAMPLES = {
    "jamp._src.autocast.api",
    "jamp._src.autocast.float8_api",
    "jamp._src.autocast.report",
    "jamp._src.dtypes",
    "jamp._src.finite.check",
    "jamp._src.float8.recipe",
    "jamp._src.float8.telemetry",
    "jamp._src.flax_support",
    "jamp._src.grad_scaler.scaler",
    "jamp._src.lookup",
    "jamp._src.loss_scale",
    "jamp._src.loss_scaling",
    "jamp._src.policy",
    "jamp._src.finite.report",
    "jamp._src.skip",
    "jamp._src.value_and_grad",
    "jamp._src.optimizer.master",
    "jamp._src.numerics.locate",
    "jamp._src.numerics.report",
    "jamp._src.optimizer.state",
}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(module) if t.examples]
    assert bool(tests) == (name in WITH_EXAMPLES), name
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def _mapped_units():
    """The units the map of ``jamp/_src/README.md`` names: the backticked name in the
    second column of each row of its table, a package with a trailing ``/``."""
    text = (ROOT / "jamp" / "_src" / "README.md").read_text()
    table = text.split("## The map", 1)[1].split("\n## ", 1)[0]
    units = set()
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and (m := re.fullmatch(r"`([a-z0-9_]+/?)`", cells[1])):
            units.add(m.group(1))
    return units


def test_the_src_map_names_every_unit():
    src = ROOT / "jamp" / "_src"
    packages = {f"{p.parent.name}/" for p in src.glob("*/__init__.py")}
    modules = {p.stem for p in src.glob("*.py") if p.name != "__init__.py"}
    units, mapped = packages | modules, _mapped_units()
    assert len(mapped) >= 10, mapped  # the table was read
    assert not units - mapped, (
        "jamp/_src/README.md's map has no row for these units (a package is written `name/`): "
        f"{sorted(units - mapped)}"
    )
    assert not mapped - units, f"the map names units that do not exist: {sorted(mapped - units)}"

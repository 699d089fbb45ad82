"""Packaging: one version, a changelog for it, floors that .ci/floors installs, pinned lint.

The floors themselves are installed and tested by ``.ci/floors`` (CI's second step), which
also checks that the sdist ships every tracked file; these tests keep the files that step
reads in agreement with ``pyproject.toml``.
"""

import pathlib
import re
import tomllib

import jamp

ROOT = pathlib.Path(__file__).resolve().parents[2]  # tests/<folder>/this file
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def floors(requirements):
    """``{name: version}`` for each ``name>=version`` requirement."""
    out = {}
    for req in requirements:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?>=([0-9.]+)", req.split(";")[0].strip())
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def test_the_version_is_written_once_in_jamp():
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "jamp.__version__"
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", jamp.__version__)
    written = [p for p in ROOT.glob("*.toml")] + [ROOT / "jamp" / "__init__.py"]
    # Assigned once (the deprecation table's since="0.2.0" names a version, it does not set one).
    assignment = re.compile(rf'version_*\s*=\s*"{re.escape(jamp.__version__)}"')
    assert sum(len(assignment.findall(p.read_text())) for p in written) == 1


def test_the_changelog_has_a_section_for_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    release = jamp.__version__.split(".dev")[0]
    assert re.search(rf"^## .*\b{re.escape(release)}\b", text, re.M), release
    for section in ("### Changed", "### Added", "### Deprecated"):
        assert section in text


def test_ci_floors_pin_the_declared_floors():
    declared = floors(PROJECT["dependencies"])
    for extra in ("flax", "equinox"):
        declared |= floors(PROJECT["optional-dependencies"][extra])
    pinned = {}
    for line in (ROOT / ".ci" / "floors.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pinned[name.lower()] = version
    assert set(declared) == {"jax", "numpy", "optax", "flax", "equinox"}
    assert {name: pinned[name] for name in declared} == declared
    assert pinned["jaxlib"] == pinned["jax"]  # jax pins its jaxlib exactly
    # Every extra that names flax or equinox names the same floor.
    for extra, reqs in PROJECT["optional-dependencies"].items():
        for name, version in floors(reqs).items():
            if name in declared:
                assert version == declared[name], (extra, name)


def test_python_floor_classifiers_and_lint_target_agree():
    assert PROJECT["requires-python"] == ">=3.11"
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py311"
    versions = [
        c for c in PROJECT["classifiers"] if c.startswith("Programming Language :: Python :: 3.")
    ]
    assert versions and all(tuple(map(int, c.split()[-1].split("."))) >= (3, 11) for c in versions)
    # An SPDX license expression, so no license classifier (PEP 639 refuses both).
    assert PROJECT["license"] == "Apache-2.0"
    assert not [c for c in PROJECT["classifiers"] if c.startswith("License ::")]


def test_pre_commit_pins_the_ruff_of_the_lint_extra():
    config = (ROOT / ".pre-commit-config.yaml").read_text()
    rev = re.search(r"astral-sh/ruff-pre-commit\n\s+rev: v([0-9.]+)", config).group(1)
    assert PROJECT["optional-dependencies"]["lint"] == [f"ruff=={rev}"]


def test_ci_lints_then_runs_the_readme_command_then_the_floors():
    run = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" && pytest' in run
    assert run.index("pytest") < run.index("bash .ci/floors")
    assert 'pip install -e ".[test,gpu-compile,lint]"' in run
    lint = run.index("ruff check . && ruff format --check .")
    assert lint < run.index("JAMP_REQUIRE_GPU_COMPILE=1 pytest")
    # The same suite on the newest jax, on Python 3.12, pinned so that a release cannot turn
    # main red unseen; jax's CUDA plugin (the gpu-compile extra) at jaxlib's version.
    assert 'suite newest "$(python_of 3.12)" -c .ci/newest.txt' in run
    newest = dict(
        line.split("#")[0].strip().split("==")
        for line in (ROOT / ".ci" / "newest.txt").read_text().splitlines()
        if line.split("#")[0].strip()
    )
    jax_version = newest["jax"]
    assert {newest[k] for k in ("jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt")} == {jax_version}
    assert tuple(map(int, jax_version.split("."))) > (0, 10, 2)
    script = (ROOT / ".ci" / "floors").read_text()
    assert "-c .ci/floors.txt" in script and '"git", "ls-files"' in script
    assert 'rm -r "$work/src/jamp"' in script  # the tests import the installed wheel
    manifest = (ROOT / "MANIFEST.in").read_text()
    for folder in ("tests", "docs", "examples", "benchmarks"):
        assert f"graft {folder}" in manifest


def test_the_wheel_ships_py_typed():
    # PEP 561: the marker is package data of jamp (.ci/floors builds the wheel from this).
    assert PYPROJECT["tool"]["setuptools"]["package-data"]["jamp"] == ["py.typed"]
    assert (ROOT / "jamp" / "py.typed").is_file()
    assert "pyright[nodejs]==" in " ".join(PROJECT["optional-dependencies"]["test"])
    assert PYPROJECT["tool"]["pyright"]["include"] == ["jamp"]


def test_the_distribution_is_jax_amp_and_imports_as_jamp():
    # PyPI's "jamp" is someone else's fork of jmp, whose wheel installs a package named jmp.
    assert PROJECT["name"] == "jax-amp"
    assert PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == ["jamp*"]
    assert "jax_amp-*" in (ROOT / ".ci" / "floors").read_text()


# `pip install jamp`, `pip install "jamp[equinox]"`, `pip install -U jamp`: the other jamp.
INSTALLS_THE_OTHER_JAMP = re.compile(r"""pip3? install(?:\s+-\S+)*\s+\\?["']?jamp\b""")


def test_no_install_line_names_the_other_jamp():
    checked = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "mkdocs.yml"]
    for folder, patterns in (
        ("docs", ["*.md"]),
        ("examples", ["*.py", "*.md"]),
        ("jamp", ["*.py"]),
        ("benchmarks", ["*.py", "*.md", "*.sh"]),
        (".ci", ["*"]),
    ):
        for pattern in patterns:
            checked += [p for p in (ROOT / folder).rglob(pattern) if p.is_file()]
    found = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in checked
        for m in INSTALLS_THE_OTHER_JAMP.finditer(p.read_text(errors="replace"))
    ]
    assert found == []
    for line in ("pip install jamp", 'pip install "jamp[equinox]"', "pip install -U jamp"):
        assert INSTALLS_THE_OTHER_JAMP.search(line), line
    assert not INSTALLS_THE_OTHER_JAMP.search('pip install "jax-amp[equinox]"')

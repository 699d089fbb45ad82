"""The import structure of ``jamp/_src`` and ``benchmarks/`` (the rule is in
``jamp/_src/README.md``): floors, packages, no cycles, no upward import, a budget of
code lines per module.

``jamp/_src`` is made of units: a ground-floor module, or a family package
(``finite/``, ``autocast/``, ``grad_scaler/``). A unit imports jax, numpy and
units of its own floor or below, never one above; inside a package, a module
imports only the package's modules listed before it. optax is imported only by
the front ends, flax only lazily by ``flax_support``, equinox never.
"""

import ast
import io
import pathlib
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "jamp" / "_src"

GROUND, CHECKS, FRONT, READERS, FACADE = range(5)
FLOORS = {
    # the vocabulary, the validators, leaves, torch rounding, the state, policies, float8
    "types": GROUND,
    "validate": GROUND,
    "leaves": GROUND,
    "torch_rounding": GROUND,
    "loss_scale": GROUND,
    "policy": GROUND,
    "float8": GROUND,
    "deprecations": GROUND,
    "jaxprs": GROUND,
    "dtypes": GROUND,
    # the checks and the shared skip machinery
    "finite": CHECKS,
    "skip": CHECKS,
    # the front ends
    "loss_scaling": FRONT,
    "value_and_grad": FRONT,
    "autocast": FRONT,
    "flax_support": FRONT,
    "optimizer": FRONT,
    # what reads the front ends' states (lookup finds them, numerics reads the metrics):
    # above them, so no front end depends on a reader of its state
    "lookup": READERS,
    "numerics": READERS,
    # the GradScaler facade over the shared pieces
    "grad_scaler": FACADE,
}
# Inside a package, the order its modules may import each other in (each only earlier ones).
PACKAGES = {
    "finite": ["default", "cpu", "check", "report"],
    "autocast": [
        "rules",
        "folding",
        "values",
        "sums",
        "residuals",
        "flow",
        "plan",
        "handlers",
        "higher_order",
        "interpreter",
        "float8",
        "transform",
        "float8_api",
        "report",
        "api",
    ],
    "grad_scaler": ["records", "state", "scaler"],
    "optimizer": ["rounding", "quantize", "master", "state"],
    "numerics": ["program", "loops", "locate", "report"],
    "float8": ["recipe", "products", "telemetry"],
}
THIRD_PARTY = {GROUND: {"jax", "numpy"}, CHECKS: {"jax", "numpy"}}
STDLIB_OK = {
    "collections",
    "contextlib",
    "dataclasses",
    "functools",
    "importlib",
    "inspect",
    "logging",
    "math",
    "numbers",
    "os",
    "sys",
    "types",
    "typing",
    "warnings",
    "weakref",
}
# Code lines per module: docstrings, comments and blank lines are not counted.
CODE_LINES = 600


def _modules():
    """``{dotted name under _src: path}`` for every module, packages' ``__init__`` aside."""
    out = {}
    for path in SRC.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        out[path.relative_to(SRC).with_suffix("").as_posix().replace("/", ".")] = path
    return out


MODULES = _modules()


def _unit(module):
    """The floor unit a module belongs to: its package, or itself."""
    return module.split(".")[0]


def _imports(path):
    """(jamp modules, third-party top-level packages, module-level third-party) ``path``
    imports; jamp modules as dotted names under ``_src``."""
    tree = ast.parse(path.read_text())
    own, other, top = set(), set(), set()
    top_level = set(map(id, tree.body))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "jamp._src" or node.module.startswith("jamp._src."):
                base = node.module.removeprefix("jamp._src").lstrip(".")
                for a in node.names:  # `from jamp._src.finite import cpu` imports a module
                    dotted = f"{base}.{a.name}".lstrip(".")
                    own.add(dotted if dotted in MODULES else base)
                continue
            if node.level == 0 and node.module != "__future__":
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
            own.update(n.removeprefix("jamp._src.") for n in names if n.startswith("jamp._src."))
            names = [n for n in names if not n.startswith("jamp")]
        for name in names:
            other.add(name.split(".")[0])
            if id(node) in top_level:
                top.add(name.split(".")[0])
    return own, other, top


def test_every_module_has_a_floor():
    assert {_unit(m) for m in MODULES} == set(FLOORS)
    for package, order in PACKAGES.items():
        inside = {m.split(".", 1)[1] for m in MODULES if _unit(m) == package and "." in m}
        assert inside == set(order), package


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_upward_import(name):
    own, other, top = _imports(MODULES[name])
    unit = _unit(name)
    for dep in own:
        assert dep in MODULES, f"{name} imports {dep}, which is not a module"
        dep_unit = _unit(dep)
        if dep_unit == unit:  # inside a package: only modules listed before this one
            order = PACKAGES[unit]
            mine, theirs = name.split(".", 1)[1], dep.split(".", 1)[1]
            assert order.index(theirs) < order.index(mine), f"{name} imports {dep}"
        else:
            assert FLOORS[dep_unit] <= FLOORS[unit], f"{name} (floor {FLOORS[unit]}) imports {dep}"
    allowed = THIRD_PARTY.get(FLOORS[unit])
    if allowed is not None:
        assert other - STDLIB_OK <= allowed, f"{name} imports {other - STDLIB_OK - allowed}"
    assert "equinox" not in other, name
    assert "flax" not in other or name == "flax_support", name
    assert "flax" not in top, f"{name} imports flax at import time"


def assert_acyclic(graph):
    """No import cycle in ``graph`` (``{module: modules it imports}``), or the cycle."""
    done, active = set(), []

    def visit(node):
        assert node not in active, " -> ".join([*active, node])
        if node in done:
            return
        active.append(node)
        for dep in graph.get(node, ()):
            visit(dep)
        active.pop()
        done.add(node)

    for name in graph:
        visit(name)


def assert_no_private_use(name, path, package, is_module):
    """``path`` neither imports a private name from ``package`` nor reads one off a module
    of it it imported (``is_module(dotted)``: whether ``from <module> import <x>`` names one)."""
    tree = ast.parse(path.read_text())
    aliases = set()  # names bound to modules: `from jamp._src import loss_scale as ls`
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package):
            private = [a.name for a in node.names if a.name.startswith("_")]
            assert not private, f"{name} imports {private} from {node.module}"
            aliases.update(a.asname or a.name for a in node.names if is_module(node.module, a.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in aliases and node.attr.startswith("_"):
                raise AssertionError(f"{name} uses {node.value.id}.{node.attr}")


def test_no_import_cycle():
    assert_acyclic({name: _imports(path)[0] for name, path in MODULES.items()})


def test_no_module_uses_another_modules_private_names():
    def is_module(module, name):  # `from jamp._src.finite import cpu`: a module
        return f"{module.removeprefix('jamp._src').lstrip('.')}.{name}".lstrip(".") in MODULES

    for name, path in MODULES.items():
        assert_no_private_use(name, path, "jamp", is_module)


def code_lines(text):
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    tree = ast.parse(text)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in skip and tok.type != tokenize.ENDMARKER:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstrings)


def test_code_lines_counts_code_only():
    text = (
        '"""Doc.\n\nMore."""\n\n# a comment\nx = 1  # trailing\n\n\n'
        'def f():\n    """Doc."""\n    return (\n        x\n    )\n'
    )
    assert code_lines(text) == 5  # x = 1, def f, return (, x, )


# A package whose modules are held to a tighter budget: autocast's interpreter is read by
# newcomers, so each of its modules stays one seam (autocast/README.md).
PACKAGE_CODE_LINES = {"autocast": 350}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_within_its_budget_of_code_lines(name):
    n = code_lines(MODULES[name].read_text())
    budget = PACKAGE_CODE_LINES.get(name.split(".")[0], CODE_LINES)
    assert n <= budget, f"{name}: {n} code lines (budget {budget})"


def test_grad_scaler_step_reaches_the_skip_machinery_directly():
    """GradScaler imports the skip module itself; the Optax wrapper only for as_optax."""
    path = MODULES["grad_scaler.scaler"]
    tree = ast.parse(path.read_text())
    own, _, _ = _imports(path)
    assert "skip" in own
    users = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Name) and node.id == "loss_scaling":
                    users.add(fn.name)
    assert users == {"as_optax"}, users


def test_every_package_has_a_folder_of_tests():
    for package in PACKAGES:
        assert list((ROOT / "tests" / package).glob("test_*.py")), package


# ---------------------------------------------------------------- benchmarks/: hub and spokes
#
# benchmarks/README.md: the hub holds what the experiments share (the models, the step
# variants, the readers of compiled programs, the timing and the writing of a section);
# each experiment is a spoke that imports the hub only; the command line imports the spokes.

BENCH = ROOT / "benchmarks"
# The hub, in order: each module imports only the hub modules listed before it.
BENCH_HUB = ["xla_gpu", "timing", "report", "measure", "models", "steps"]
BENCH_SPOKES = [
    "loss_scaling", "finite_checks", "gpu_compile", "autocast_memory", "float8", "real_models",
    "optimizer_memory", "batchnorm", "debug_cost", "collectives",
]  # fmt: skip
BENCH_ENTRY = ["cli", "__main__"]
# A hub module is a file or a package (benchmarks/models/: one module by kind of model); each
# file of either is held to the per-module budget of code lines (CODE_LINES). There is no
# budget for the benchmarks' lines in all: it was raised three times in one day, then met by
# folding a signature (issue #43); the per-module cap is the trigger to split along a seam.
BENCH_MODULES = {p.stem: [p] for p in BENCH.glob("*.py") if p.name != "__init__.py"}  # name: files
BENCH_MODULES.update(
    {i.parent.name: sorted(i.parent.glob("*.py")) for i in BENCH.glob("*/__init__.py")}
)


def _bench_imports(paths):
    """The benchmarks modules the files ``paths`` of one module import, at their top or inside
    a function (a package's files importing each other are the package itself)."""
    out = set()
    nodes = [n for path in paths for n in ast.walk(ast.parse(path.read_text()))]
    own = {p.parent.name for p in paths if p.name == "__init__.py"}
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module == "benchmarks" or (node.level and not module):  # `from . import models`
                out.update(a.name for a in node.names)
            elif module.startswith("benchmarks."):
                out.add(module.split(".")[1])
            elif node.level:  # `from .models import Model`
                out.add(module.split(".")[0])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks."))
    return out - own


def test_every_benchmarks_module_is_hub_spoke_or_entry():
    assert set(BENCH_MODULES) == {*BENCH_HUB, *BENCH_SPOKES, *BENCH_ENTRY}


@pytest.mark.parametrize("name", BENCH_HUB)
def test_benchmarks_hub_imports_only_the_hub_before_it(name):
    deps = _bench_imports(BENCH_MODULES[name])
    assert deps <= set(BENCH_HUB[: BENCH_HUB.index(name)]), f"{name} imports {deps}"


@pytest.mark.parametrize("name", BENCH_SPOKES)
def test_benchmarks_spoke_imports_only_the_hub(name):
    deps = _bench_imports(BENCH_MODULES[name])
    assert deps <= set(BENCH_HUB), f"{name} imports {deps - set(BENCH_HUB)}"


def test_no_benchmarks_import_cycle():
    assert_acyclic({name: _bench_imports(path) for name, path in BENCH_MODULES.items()})


def test_no_benchmarks_module_uses_another_modules_private_names():
    for name, paths in BENCH_MODULES.items():
        for path in paths:
            assert_no_private_use(
                name, path, "benchmarks", lambda module, _: module == "benchmarks"
            )


def _module_level(tree):
    """The nodes a module runs when imported: not inside a function, class or lambda body."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def _is_environ(node):
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


@pytest.mark.parametrize("name", sorted(BENCH_MODULES))
def test_no_benchmarks_module_sets_the_environment_at_import(name):
    """JAX_PLATFORMS and the like are set in the CLI's main(), before jax starts a backend,
    or by the tests' conftest: never as a side effect of importing a module."""
    nodes = [n for p in BENCH_MODULES[name] for n in _module_level(ast.parse(p.read_text()))]
    for node in nodes:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            assert not (isinstance(target, ast.Subscript) and _is_environ(target.value)), name
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            writes = node.func.attr in ("setdefault", "update", "pop", "__setitem__")
            assert not (writes and _is_environ(node.func.value)), f"{name} sets os.environ"
            assert node.func.attr != "putenv", f"{name} calls os.putenv"


BENCH_PATHS = sorted(str(p.relative_to(BENCH)) for paths in BENCH_MODULES.values() for p in paths)


@pytest.mark.parametrize("path", BENCH_PATHS)
def test_benchmarks_module_within_its_budget_of_code_lines(path):
    n = code_lines((BENCH / path).read_text())
    assert n <= CODE_LINES, f"benchmarks/{path}: {n} code lines (budget {CODE_LINES})"

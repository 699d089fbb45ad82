"""The import structure of ``jamp/_src``: floors, no cycles, no upward import.

Each module belongs to a floor; it may import jax, numpy and modules of its
own floor or below, never one above. optax is imported only by the front
ends; flax by nothing at import time.
"""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parent.parent / "jamp" / "_src"

GROUND, CHECKS, FRONT, FACADE = range(4)
FLOORS = {
    # state and its rule, tree/leaf utilities, torch rounding, policy, float8 products
    "config": GROUND,
    "leaves": GROUND,
    "torch_rounding": GROUND,
    "loss_scale": GROUND,
    "policy": GROUND,
    "float8": GROUND,
    "deprecations": GROUND,
    # the checks and the shared skip machinery
    "finite_default": CHECKS,
    "finite_cpu": CHECKS,
    "finite": CHECKS,
    "skip": CHECKS,
    "report": CHECKS,
    # the front ends
    "loss_scaling": FRONT,
    "value_and_grad": FRONT,
    "lookup": FRONT,
    "autocast_rules": FRONT,
    "autocast_residuals": FRONT,
    "autocast_sums": FRONT,
    "autocast_values": FRONT,
    "autocast_flow": FRONT,
    "autocast_interpreter": FRONT,
    "autocast_float8": FRONT,
    "autocast": FRONT,
    "flax_support": FRONT,
    # the GradScaler facade over the shared pieces
    "grad_scaler": FACADE,
    "step_records": FACADE,
}
THIRD_PARTY = {GROUND: {"jax", "numpy"}, CHECKS: {"jax", "numpy"}}
MAX_LINES = 800


def _modules():
    return sorted(p.stem for p in SRC.glob("*.py") if p.stem != "__init__")


def _imports(name):
    """(jamp modules, third-party top-level packages) that ``name`` imports, anywhere in it."""
    tree = ast.parse((SRC / f"{name}.py").read_text())
    own, other = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "jamp._src":
                own.update(a.name for a in node.names)
            elif node.module.startswith("jamp._src."):
                own.add(node.module.split(".")[2])
            elif node.level == 0 and node.module != "__future__":
                other.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("jamp._src."):
                    own.add(a.name.split(".")[2])
                else:
                    other.add(a.name.split(".")[0])
    return own, other


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
    "types",
    "typing",
    "warnings",
}


def test_every_module_has_a_floor():
    assert set(_modules()) == set(FLOORS)


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_no_upward_import(name):
    own, other = _imports(name)
    for dep in own:
        assert FLOORS[dep] <= FLOORS[name], f"{name} (floor {FLOORS[name]}) imports {dep}"
    allowed = THIRD_PARTY.get(FLOORS[name])
    if allowed is not None:
        assert other - STDLIB_OK <= allowed, f"{name} imports {other - STDLIB_OK - allowed}"
    assert "flax" not in other or name == "flax_support", name


def test_no_import_cycle():
    graph = {name: _imports(name)[0] for name in FLOORS}
    done, active = set(), []

    def visit(node):
        assert node not in active, " -> ".join([*active, node])
        if node in done:
            return
        active.append(node)
        for dep in graph[node]:
            visit(dep)
        active.pop()
        done.add(node)

    for name in graph:
        visit(name)


def test_no_module_uses_another_modules_private_names():
    for name in FLOORS:
        tree = ast.parse((SRC / f"{name}.py").read_text())
        aliases = set()  # names bound to jamp modules: `from jamp._src import loss_scale as ls`
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jamp"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{name} imports {private} from {node.module}"
                if node.module == "jamp._src":
                    aliases.update(a.asname or a.name for a in node.names)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id in aliases and node.attr.startswith("_"):
                    raise AssertionError(f"{name} uses {node.value.id}.{node.attr}")


def test_no_library_module_over_800_lines():
    for path in SRC.glob("*.py"):
        n = len(path.read_text().splitlines())
        assert n <= MAX_LINES, f"{path.name}: {n} lines"


def test_grad_scaler_step_reaches_the_skip_machinery_directly():
    """GradScaler imports the skip module itself; the Optax wrapper only for as_optax."""
    tree = ast.parse((SRC / "grad_scaler.py").read_text())
    own, _ = _imports("grad_scaler")
    assert "skip" in own
    users = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Name) and node.id == "loss_scaling":
                    users.add(fn.name)
    assert users == {"as_optax"}, users

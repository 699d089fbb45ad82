"""pyright reports no error on jamp/ nor on a user's typed program (PEP 561: jamp ships
``py.typed``).

``typing_usage.py`` uses the public API as a typed training loop would and pins return
types with ``typing.assert_type``; the settings are ``[tool.pyright]`` in pyproject.toml.
One pyright run checks both (about 20-30 s on 2 busy cores, most of it reading jax).
"""

import json
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]  # tests/<folder>/this file
USAGE = pathlib.Path(__file__).with_name("typing_usage.py")


def pyright() -> list[str]:
    here = pathlib.Path(sys.executable).parent / "pyright"
    return [str(here)] if here.exists() else [shutil.which("pyright") or "pyright"]


def test_jamp_ships_py_typed():
    assert (ROOT / "jamp" / "py.typed").is_file()


def test_pyright_finds_no_error_in_jamp_or_in_typed_user_code():
    proc = subprocess.run(
        [*pyright(), "--outputjson", "--pythonpath", sys.executable, "jamp", str(USAGE)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(proc.stdout)
    errors = [
        f"{d['file']}:{d['range']['start']['line'] + 1}: {d['message']}"
        for d in report["generalDiagnostics"]
        if d["severity"] == "error"
    ]
    assert not errors, "\n".join(errors)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    checked = report["summary"]["filesAnalyzed"]
    assert checked >= len(list((ROOT / "jamp").rglob("*.py"))) + 1, checked

"""Running a benchmark module in a fresh interpreter, for the smoke tests (not a test module)."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_benchmark(module: str, *args: str, timeout: int = 600) -> str:
    """``python -m <module> *args`` on the CPU; its stdout, after asserting it succeeded.

    A fresh interpreter: the benchmark must not inherit the test session's
    strict dtype promotion or its 8 virtual devices. Less LLVM optimisation:
    compiles dominate a tiny run, and timings are never checked.
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # benchmarks count and time their compiles
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout

"""Strict numerics for every test: 8 virtual CPU devices, strict dtype promotion."""

import os

# Must happen before jax initialises its backends.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# Less LLVM optimisation of the compiled code (XLA's HLO passes, fusion and buffer
# assignment are unchanged, and so is the IEEE arithmetic): the suite is compile-bound,
# and this cuts its CPU time by about a fifth. Set the flag yourself to test at -O2.
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
# XLA:CPU's elemental kernel emitters in place of its MLIR fusion emitters, where jaxlib
# still has the choice (0.10; jaxlib 0.12 has only the fusion emitters and aborts on the
# flag): the same HLO passes, fusions and buffers, each fusion's kernel emitted by the
# older path, which compiles it in about half the time. On jax 0.10.2 the suite's CPU time
# drops by about two fifths. The arithmetic is IEEE either way; LLVM may contract a
# product and a sum into one rounding in one program and not in another, so a test that
# compares two different programs bit for bit uses exact arithmetic (a power-of-two rate,
# as tests/optimizer/test_transformation_contract.py does). CI's suite on jax 0.12 runs
# the fusion emitters; give the flag yourself (=true) to run them on 0.10.
if "xla_cpu_use_fusion_emitters" not in _flags:
    from importlib.metadata import version as _version

    if tuple(int(p) for p in _version("jaxlib").split(".")[:2]) == (0, 10):
        _flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the whole run, a folder for each xdist worker (the
# controller makes the run's folder before they start, and removes it at the end): the
# suite compiles many identical programs (parametrized eager/jit twins, the same kernels
# in several tests), and a cache hit is the same executable. About a fifth of the CPU time.
# Not one folder for both workers: jax writes an entry in place, so a worker reading an
# entry the other is still writing gets a truncated executable, which jax reports as a
# warning ("Error reading persistent compilation cache entry"), an error here. Only a loaded
# machine widens that window, and the failures seen there fit it: the seeded twins of
# test_locate.py, identical programs that the two workers compile at once. jax's locked
# cache (a size limit and `filelock`) was not chosen: each write then lists the whole
# folder, and one orphaned entry stops every later write (jax issue 39880).
# A JAX_COMPILATION_CACHE_DIR of your own is used as it is and kept.
if "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jamp-tests-xla-")
    os.environ["JAMP_TESTS_OWN_XLA_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
if os.environ.get("JAMP_TESTS_OWN_XLA_CACHE") and "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
        os.environ["JAMP_TESTS_OWN_XLA_CACHE"], os.environ["PYTEST_XDIST_WORKER"]
    )
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _standard_promotion_for_marked(request):
    """Relax dtype promotion only for tests marked ``standard_promotion``.

    Optax's Adam family computes its bias correction as ``decay ** count`` with
    an int32 ``count``, which strict promotion rejects inside optax itself.
    Tests that run those optimizers carry the marker; every jamp code path
    they exercise is also covered by strict tests with SGD.
    """
    if request.node.get_closest_marker("standard_promotion"):
        with jax.numpy_dtype_promotion("standard"):
            yield
    else:
        yield


def pytest_unconfigure(config):
    own = os.environ.get("JAMP_TESTS_OWN_XLA_CACHE")
    if own and "PYTEST_XDIST_WORKER" not in os.environ:
        import shutil

        shutil.rmtree(own, ignore_errors=True)


# ---------------------------------------------------------------- the tiers
# Three markers, set here by where a test lives and what it uses, so that no test file
# carries them and a moved file keeps its tier (`pytest -m "not gpu_compile"`, `-m slow`):
# - gpu_compile: the test uses the `gpu_compiler` fixture (XLA:GPU's deviceless compiler);
# - project: under tests/project/ (docs, packaging, typing, examples, benchmark smoke);
# - slow: the real-model accuracy gate, and the tests listed in SLOW (with `-n 0
#   --durations` on the 2-core machine, loaded by other runs: 5 to 190 s each).
# README's `pytest` runs all three tiers: the markers select, they deselect nothing.
SLOW = (
    "tests/realmodels/",
    "tests/project/test_typing.py::test_pyright",
    "tests/project/test_docs_build.py::test_mkdocs_build_strict",
    "tests/project/test_examples.py",  # most train an example for a few steps
    "tests/project/test_benchmarks.py::test_tiny_run",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        nodeid = item.nodeid.replace(os.sep, "/")
        if "gpu_compiler" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.gpu_compile)
        if nodeid.startswith("tests/project/"):
            item.add_marker(pytest.mark.project)
        if nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)


def require_gpu_compiler():
    """Skip when XLA:GPU's deviceless compiler is missing, saying why; fail instead under
    JAMP_REQUIRE_GPU_COMPILE=1 (as .ci/run sets it)."""
    from benchmarks import xla_gpu

    reason = xla_gpu.unavailable()
    if reason is not None:
        if os.environ.get("JAMP_REQUIRE_GPU_COMPILE") == "1":
            pytest.fail(f"JAMP_REQUIRE_GPU_COMPILE=1 but {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def gpu_compiler():
    """Skip (or fail) a module that needs XLA:GPU's deviceless compiler when it is
    missing: ``require_gpu_compiler``."""
    require_gpu_compiler()


def _compile_each_program_once():
    """One compile per distinct GPU program in each worker, whichever file asks for it.

    A deviceless GPU program cannot be loaded from the persistent compilation cache (no
    device client), so without this a program that two tests (or two files) lower alike
    is compiled twice. The key is the lowered module's text with its debug information
    (source locations and name stacks), so a hit is the same program with the same op
    names, which some tests read; the suite compiles for one target (the H200), which the
    text does not name. Measured: the suite's 80 GPU compiles are 76 distinct programs (the
    repeats were the availability probe, once per module). `xla_gpu.compile_lowered` stays
    the one compiler: a miss goes through it, and the dump below sees every call, hit or
    miss (a dump before and after this cache holds the same programs under the same names).
    """
    from benchmarks import xla_gpu

    compile_lowered = xla_gpu.compile_lowered
    compiled: dict[str, object] = {}

    def cached(lowered):
        key = lowered.as_text(debug_info=True)
        if key not in compiled:
            compiled[key] = compile_lowered(lowered)
        return compiled[key]

    xla_gpu.compile_lowered = cached


_compile_each_program_once()


if os.environ.get("JAMP_DUMP_GPU_HLO"):
    # For a refactor's "every GPU program is unchanged" check: each program the suite
    # compiles for the GPU target is written to $JAMP_DUMP_GPU_HLO, named by its test and
    # its order there. Compare two dumps with `python -m tests.hlo_diff OLD NEW`.
    import itertools
    import re

    from benchmarks import xla_gpu as _xla_gpu

    _compile_lowered = _xla_gpu.compile_lowered
    _dumped: dict[str, itertools.count] = {}

    def _compile_and_dump(lowered):
        compiled = _compile_lowered(lowered)
        test = os.environ.get("PYTEST_CURRENT_TEST", "outside-a-test").rsplit(" ", 1)[0]
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", test)
        n = next(_dumped.setdefault(name, itertools.count()))
        path = os.path.join(os.environ["JAMP_DUMP_GPU_HLO"], f"{name}.{n}.hlo")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(compiled.as_text())
        return compiled

    _xla_gpu.compile_lowered = _compile_and_dump

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
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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

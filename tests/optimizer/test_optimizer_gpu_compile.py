"""The optimizer step of each optimizer-memory recipe, compiled for an H200 (deviceless,
``benchmarks/xla_gpu.py``): bytes moved per parameter and kernels, against plain float32
adamw's, on the same eight 1024x1024 leaves. The compiler's program is deterministic."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import jamp
from benchmarks import xla_gpu

# adamw: optax's adam family needs standard promotion (conftest).
pytestmark = [pytest.mark.usefixtures("gpu_compiler"), pytest.mark.standard_promotion]

LEAVES, SHAPE = 8, (1024, 1024)
N = LEAVES * SHAPE[0] * SHAPE[1]
BF = {"mu": jnp.bfloat16, "nu": jnp.bfloat16}


def _recipes():
    adamw = functools.partial(optax.adamw, 1e-3)
    lp = jamp.low_precision_state
    return {
        "plain": (adamw(), jnp.float32),
        "exact": (jamp.master_weights(adamw()), jnp.bfloat16),
        "stochastic": (jamp.master_weights(lp(adamw(), BF), rounding="stochastic"), jnp.bfloat16),
        "nearest": (
            jamp.master_weights(lp(adamw(), BF, rounding="nearest"), rounding="nearest"),
            jnp.bfloat16,
        ),
        "kahan": (jamp.master_weights(lp(adamw(), BF), rounding="kahan"), jnp.bfloat16),
        "8bit": (lp(adamw(), {"mu": "8bit", "nu": "8bit"}), jnp.float32),
    }


def _fingerprints(program):
    """The kernels of exact's and Kahan's fingerprints (256 elements of each leaf)."""
    return [k for k in program.kernels if "/fingerprint/" in k.op_name]


def _per_param(program):
    """Bytes moved per parameter, to 0.01 (the scalars' few bytes aside), but the
    fingerprints': the model counts a kernel's operands whole, and theirs read 256
    elements of each parameter (4 KiB here), not the 16 MiB of the 8 leaves."""
    fingerprints = sum(k.bytes for k in _fingerprints(program))
    return round((program.bytes - fingerprints) / N, 2)


@functools.cache
def _programs():
    out = {}
    for name, (tx, dtype) in _recipes().items():
        params = {f"w{i}": jax.ShapeDtypeStruct(SHAPE, dtype) for i in range(LEAVES)}
        state = jax.eval_shape(tx.init, params)

        def step(p, g, s, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        compiled = xla_gpu.compile_for(step, params, params, state, donate_argnums=(0, 2))
        out[name] = xla_gpu.analyse(compiled)
    return out


def test_plain_adamw_moves_28_bytes_a_parameter():
    """The baseline: read p, g, mu, nu and write p, mu, nu, float32 each."""
    assert _per_param(_programs()["plain"]) == 28.0


def test_stochastic_with_bfloat16_moments_sits_at_the_floor():
    """14 of plain's 28 bytes a parameter (0.5x, target <= 0.51x), and stochastic rounding
    costs no byte over to-nearest: its random bits are made in the update's kernel."""
    p = _programs()
    assert _per_param(p["stochastic"]) == 14.0
    assert p["stochastic"].bytes <= 0.51 * p["plain"].bytes
    assert p["stochastic"].bytes <= 1.02 * p["nearest"].bytes
    assert p["stochastic"].temp_bytes < 2**16  # no parameter-sized buffer: the bits are not stored


def test_exact_and_kahan_bytes():
    """exact: the bfloat16 parameter and its int16 low bits beside float32 moments, 26
    bytes (0.93x, target <= 0.94x); Kahan with bfloat16 moments: 18. Their float32 and
    bfloat16 updates are not written: the step adds them in the kernel that makes them."""
    p = _programs()
    assert _per_param(p["exact"]) == 26.0 and _per_param(p["exact"]) <= 0.94 * 28
    assert _per_param(p["kahan"]) == 18.0


def test_kernels_against_plain_adamw():
    """stochastic and nearest launch no more kernels than plain adamw. exact and Kahan
    launch three more: the fingerprints of the parameters they are given and of the
    ones their updates give (256 elements of each leaf, all leaves in one kernel each),
    and the restart count's add. Kahan (and any recipe whose stochastic counter is
    advanced alone) launches one more again: a 12-byte kernel that steps the counter and
    mixes the step's key, which XLA does not fuse into the per-leaf kernels (it does not
    duplicate the mix per element)."""
    p = _programs()
    plain = p["plain"].n_kernels
    for name in ("stochastic", "nearest"):
        assert p[name].n_kernels <= plain, (name, p[name].n_kernels, plain)
        assert not _fingerprints(p[name])
    for name in ("exact", "kahan"):
        assert len(_fingerprints(p[name])) == 2, name
    assert p["exact"].n_kernels == plain + 3
    assert p["kahan"].n_kernels == plain + 4
    assert p["kahan"].conditionals == 0


def test_eight_bit_moments_cost_step_bytes_for_their_memory():
    """8-bit moments keep 2.03 bytes a parameter between steps, but XLA splits the step in
    two passes (each block's absmax, then the codes), re-reading the float32 inputs: the
    step moves more bytes than plain adamw's. Pinned so that a change shows."""
    p = _programs()
    assert p["8bit"].bytes <= 37 * N
    assert p["8bit"].bytes > p["plain"].bytes

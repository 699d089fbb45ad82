"""The RULES table of autocast: every primitive it must know is in it, with its rule."""

import jax
import jax.numpy as jnp
import pytest
from _autocast_helpers import (
    EPS,
    F16,
    HALF,
    assert_close_tree,
    eqns_named,
    in_dtypes,
    is_scale,
    randn,
    walk,
)
from jax import lax

import jamp
from jamp._src.autocast.api import RULES

F32_ONLY = {
    "complex": lambda h: jnp.abs(lax.complex(h, 2.0 * h)),
    "conj": lambda h: jnp.real(lax.conj(h)),
    "fft": lambda h: jnp.abs(jnp.fft.rfft(h)),
    "qr": lambda h: jnp.abs(jnp.linalg.qr(h)[1]),
    "cholesky": lambda h: jnp.linalg.cholesky(h @ h.T + 4.0 * jnp.eye(4)),
    "eigh": lambda h: jnp.linalg.eigh(h + h.T)[0],
    "svd": lambda h: jnp.linalg.svd(h, compute_uv=False),
    "solve": lambda h: jnp.linalg.solve(h + 4.0 * jnp.eye(4), h),
    "triangular_solve": lambda h: jax.scipy.linalg.solve_triangular(
        jnp.tril(h) + 4.0 * jnp.eye(4), h, lower=True),
    "slogdet": lambda h: jnp.linalg.slogdet(h + 4.0 * jnp.eye(4))[1],
}  # fmt: skip


@pytest.mark.parametrize("op", list(F32_ONLY))
def test_primitives_that_accept_only_float32_run_in_float32(op):
    def f(x, w):
        return F32_ONLY[op](x @ w)  # the matmul output arrives in float16

    x, w = randn(0, 4, 4), randn(1, 4, 4, scale=0.5)
    report = jamp.debug.autocast_report(f, x, w, dtype=F16)
    assert report.unknown == ()
    jaxpr = jax.make_jaxpr(jamp.autocast(f, F16))(x, w)
    assert in_dtypes(eqns_named(jaxpr, "dot_general")[0]) == [F16, F16]
    for eqn in walk(jaxpr):
        if RULES.get(eqn.primitive.name) == "float32" and not is_scale(eqn):
            assert not set(in_dtypes(eqn)) & set(HALF), eqn
    got, want = jax.jit(jamp.autocast(f, F16))(x, w), jax.jit(f)(x, w)
    assert got.dtype == want.dtype
    assert_close_tree(got, want, 20 * EPS[F16])


def test_primitives_found_in_review_are_in_the_table():
    edges = jnp.linspace(0.0, 1.0, 5)

    def f(x):
        h = x @ x
        jax.debug.print("{}", h[0, 0])
        return (jnp.searchsorted(edges, h), jnp.linalg.solve(h + 4.0 * jnp.eye(4), h),
                jnp.linalg.slogdet(h + 4.0 * jnp.eye(4))[1])  # fmt: skip

    report = jamp.debug.autocast_report(f, randn(0, 4, 4))
    names = {row[0] for row in report.rows}
    assert {"debug_print", "custom_linear_solve", "platform_index"} <= names
    # searchsorted: le_to in jax 0.10, a "hijax" primitive (call_hi_primitive) in jax 0.12
    assert {"le_to", "call_hi_primitive"} & names
    assert report.unknown == ()
    bins, _, _ = jax.jit(jamp.autocast(f))(randn(0, 4, 4))  # it runs, as traced
    assert bins.dtype == jnp.int32 and bins.shape == (4, 4)

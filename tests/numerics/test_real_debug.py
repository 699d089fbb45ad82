"""``jamp.debug`` on models as their users write them (issue 44): an NNX model whose state
holds dropout's typed PRNG key, a legacy ``PRNGKey`` argument, a non-finite constant, a
``GradScaler`` state, the dtype spellings ``jamp.autocast`` takes, and a gradient function
given instead of the loss."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jamp


def _line_of(fun, text):
    """``file:line`` of the first line of ``fun``'s source holding ``text``."""
    lines, start = inspect.getsourcelines(fun)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"{fun.__code__.co_filename.rsplit('/', 1)[-1]}:{start + offset}"


# ---------------------------------------------------------------- 1. PRNG keys


class DropoutMLP(nnx.Module):
    """nnx's own layers, as its examples write them: Linear, Dropout, Rngs."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.head = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        h = self.dropout(nnx.relu(self.hidden(x)))
        return self.head(h)


def _nnx_step():
    """The loss of an NNX model over its parameters, with the rest of its state (dropout's
    typed key and its counter) passed beside them, as nnx.split gives them."""
    model = DropoutMLP(nnx.Rngs(0, dropout=1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    keys = [
        x
        for x in jax.tree_util.tree_leaves(rest)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
    ]
    assert keys, "the model's state holds a typed key"

    def loss(params, rest, x):
        m = nnx.merge(graphdef, params, rest, copy=True)
        y = m(x)
        return jnp.mean(jnp.exp(y))  # overflows when y is large

    return loss, params, rest


def test_nnx_model_with_dropout_key_is_reported_and_located():
    """A typed key in an NNX model's state is carried through unwidened: the report runs,
    and the locator names the planted overflow (it crashed on the key before)."""
    loss, params, rest = _nnx_step()
    x = jax.random.normal(jax.random.PRNGKey(2), (8, 4))
    report = jamp.debug.precision_report(loss, params, rest, x, dtype=jnp.bfloat16)
    assert report.rows and np.isfinite(report.recipes[0].loss)
    assert any("hidden" in g.path and "kernel" in g.path for g in report.gradients)
    assert jamp.debug.locate_nonfinite(loss, params, rest, x) is None
    site = jamp.debug.locate_nonfinite(loss, params, rest, x * 1e4)
    assert site is not None and site.primitive == "exp" and not site.backward
    assert site.line.startswith(_line_of(loss, "jnp.exp"))


def test_legacy_prng_key_argument():
    """A legacy uint32 ``PRNGKey`` argument, turned into random numbers inside the step."""

    def loss(w, key, x):
        noise = jax.random.normal(key, (3, 2))
        return jnp.mean((x @ w) * noise)

    w, key, x = jnp.ones((4, 2)), jax.random.PRNGKey(0), jnp.ones((3, 4))
    report = jamp.debug.precision_report(loss, w, key, x, dtype=jnp.float16)
    assert report.rows and [g.path for g in report.gradients] == ["argument 0"]
    assert jamp.debug.locate_nonfinite(loss, w, key, x) is None
    typed = jax.random.key(0)
    assert jamp.debug.precision_report(loss, w, typed, x).rows
    assert jamp.debug.locate_nonfinite(loss, w, typed, x) is None

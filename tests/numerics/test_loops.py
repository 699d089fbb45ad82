"""``jamp.debug`` inside loops (issue 44, 8): a GRU under ``scan`` (flax's ``nn.RNN`` of a
``GRUCell``) and a stack of transformer blocks scanned over its layers (one ``nn.scan``,
as MaxText and levanter write it). The locator names the iteration (the time step, the
layer) and the operation inside the body, forward and backward; the report's rows are
the body's operations, over all iterations, not one row for the scan."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from _source import line_of as _line_of

import jamp

# ---------------------------------------------------------------- a GRU under scan


class GRU(nn.Module):
    """A GRU over the time axis, as flax's examples write it, then a readout."""

    @nn.compact
    def __call__(self, x):
        y = nn.RNN(nn.GRUCell(features=8))(x)
        return nn.Dense(1)(y)


GRU_MODEL = GRU()


def _gru_loss(params, x, scale):
    return jnp.mean(GRU_MODEL.apply(params, x) ** 2) * scale


@pytest.fixture(scope="module")
def gru():
    x = jax.random.normal(jax.random.key(1), (2, 6, 4))
    return jax.jit(GRU_MODEL.init)(jax.random.key(0), x), x  # one compile, not one per op


def test_gru_backward_overflow_is_named_at_its_time_step(gru):
    # Planted at time step 3: its input scaled by 1e30 and the cell's input kernels by
    # 1e-30, so the forward pass sees the same pre-activations there, finite; the
    # gradient of the input kernels at that step, x_t^T g, overflows under a loss scale
    # (the site's pass says the forward pass held).
    params, x = gru
    big = 1e30
    cell = dict(params["params"]["GRUCell_0"])
    for gate in ("ir", "iz", "in"):
        cell[gate] = {**cell[gate], "kernel": cell[gate]["kernel"] / big}
    planted = {"params": {**params["params"], "GRUCell_0": cell}}
    hot = x.at[:, 3].multiply(big)
    site = jamp.debug.locate_nonfinite(_gru_loss, planted, hot, 1e11)
    assert site is not None and site.iteration == (3,), str(site)
    assert (site.primitive, site.pass_) == ("dot_general", "backward"), str(site)
    assert site.path.endswith("GRUCell_0/in") or site.path.endswith("GRUCell_0/iz"), site.path
    assert site.line.startswith(_line_of(GRU.__call__, "nn.RNN(") + " "), str(site)
    assert "iteration 3 of scan" in str(site)


def test_gru_report_rows_are_the_cell_s_operations(gru):
    # Under float16, step 2's input (6e4, which float16 holds) overflows the input gates'
    # products: the top rows are those products inside the scan's body, over its 6 steps.
    params, x = gru
    hot = x.at[:, 2].set(6e4)
    report = jamp.debug.precision_report(_gru_loss, params, hot, 1.0, dtype="float16", top=1000)
    assert not any(r.primitive == "scan" for r in report.rows), report
    top = report.rows[0]
    assert (top.primitive, top.pass_) == ("dot_general", "forward") and top.overflow > 0, report
    assert top.loops and "6 iterations" in top.loops[0], top
    assert "GRUCell_0" in top.path, top
    inside = [r for r in report.rows if r.loops]
    assert any(r.backward for r in inside) and any(not r.backward for r in inside)
    # Source lines (issue 44, 5): autocast's casts and roundings, the scans it traced and
    # their bodies' operations had none ('?'); each now has its nearest operation's.
    assert all(r.line != "?" for r in report.rows), [r for r in report.rows if r.line == "?"]
    assert {r.primitive for r in report.rows} >= {"reduce_precision", "convert_element_type"}
    loop_line = _line_of(GRU.__call__, "nn.RNN(")
    assert top.loops[0].startswith(f"scan at {loop_line} "), top.loops
    assert f"(in the scan at {loop_line} " in str(report)


# ---------------------------------------------------------------- a scanned transformer


class Block(nn.Module):
    """A pre-norm transformer block, the body of the scan over layers."""

    width: int

    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
        h = nn.LayerNorm()(x)
        h = nn.Dense(2 * self.width, name="up")(h)  # the MLP
        h = nn.Dense(self.width, name="down")(nn.gelu(h))
        return x + h, None


class Stack(nn.Module):
    """``layers`` blocks, their parameters stacked, run by one scan (MaxText's
    ``scan_layers``)."""

    layers: int = 3
    width: int = 32

    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.layers,
        )
        x, _ = blocks(self.width, name="layers")(x, None)
        return x


STACK = Stack()


def _stack_loss(params, x, scale):
    return jnp.mean(STACK.apply(params, x) ** 2) * scale


@pytest.fixture(scope="module")
def stack():
    x = jax.random.normal(jax.random.key(1), (2, 4, 32))
    return jax.jit(STACK.init)(jax.random.key(0), x), x


def _scaled(params, which, factor, layer=1):
    """``params`` with layer ``layer``'s ``which`` Dense kernel multiplied by ``factor``."""
    layers = params["params"]["layers"]
    dense = dict(layers[which])
    dense["kernel"] = dense["kernel"].at[layer].multiply(factor)
    return {"params": {**params["params"], "layers": {**layers, which: dense}}}


def test_scanned_stack_forward_overflow_names_the_layer_and_its_mlp(stack):
    params, x = stack
    line = _line_of(Block.__call__, 'name="up"') + " "
    hot = _scaled(_scaled(params, "up", 2e19), "up", 2e19)  # each entry finite, below 3e38
    site = jamp.debug.locate_nonfinite(_stack_loss, hot, x, 1.0)
    assert site is not None and site.iteration == (1,), str(site)
    assert (site.primitive, site.pass_) == ("dot_general", "forward"), str(site)
    assert site.line.startswith(line) and site.path.endswith("up"), str(site)
    assert "iteration 1 of scan" in str(site) and site.inf > 0


def test_scanned_stack_backward_overflow_names_the_layer(stack):
    # Layer 1's MLP: its first kernel scaled by 1e-30, its second by 1e30: the forward
    # pass is as finite as before, the gradient through the second kernel is not (the
    # backward pass's reversed scan meets layer 2 first, then layer 1).
    params, x = stack
    planted = _scaled(_scaled(params, "up", 1e-30), "down", 1e30)
    site = jamp.debug.locate_nonfinite(_stack_loss, planted, x, 1e10)
    assert site is not None and site.iteration == (1,), str(site)
    assert (site.primitive, site.pass_) == ("dot_general", "backward"), str(site)
    assert "layers" in site.path and site.line.startswith(
        _line_of(Block.__call__, "nn.Dense(")[:-3]
    )


# ---------------------------------------------------------------- while and cond


def _grow(w, x):
    """A ``while`` over an argument that is not differentiated (reverse mode cannot go
    through one): x multiplied by 10 at each of 50 iterations, which float32 holds for
    38 of them; then a ``cond`` whose taken branch overflows for large ``w``."""

    def body(c):
        i, h = c
        return i + 1, h * 10.0

    _, h = jax.lax.while_loop(lambda c: c[0] < 50, body, (0, x))
    y = jax.lax.cond(w[0] > 0, lambda v: jnp.exp(v), lambda v: v, w)
    return jnp.sum(w * h) + jnp.sum(y)


def test_while_and_cond_are_entered():
    ones = jnp.ones(2)
    site = jamp.debug.locate_nonfinite(_grow, ones, ones)
    assert site is not None and site.iteration == (38,), str(site)
    assert site.primitive == "mul" and "iteration 38 of while" in str(site)
    assert site.line.startswith(_line_of(_grow, "h * 10.0") + " "), str(site)
    site = jamp.debug.locate_nonfinite(_grow, jnp.full(2, 100.0), jnp.zeros(2))
    assert site is not None and (site.primitive, site.iteration) == ("exp", (1,)), str(site)
    assert "branch 1 of cond" in str(site) and not site.backward


def _nested(w, x):
    """A scan over rows whose body scans over columns: the inner product overflows at row
    2, column 1 (x's only large entry)."""

    def row(carry, xr):
        def col(c, v):
            return c + jnp.sum(v * w), jnp.tanh(v * w)  # the inner body's product

        total, ys = jax.lax.scan(col, carry, xr)
        return total, ys

    total, ys = jax.lax.scan(row, 0.0, x)
    return total * 1e-6 + jnp.sum(ys)


def test_nested_scans_are_entered_in_turn():
    w, x = jnp.ones(3), jnp.ones((4, 2, 3))
    hot = x.at[2, 1].set(1e37)
    site = jamp.debug.locate_nonfinite(_nested, w * 1e2, hot)
    assert site is not None and site.iteration == (2, 1), str(site)
    assert site.primitive == "mul" and len(site.loops) == 2, str(site)
    assert site.line.startswith(_line_of(_nested, "the inner body's product") + " "), str(site)
    report = jamp.debug.precision_report(_nested, w, x, dtype="float16")
    assert not any(r.primitive == "scan" for r in report.rows)
    inner = [r for r in report.rows if len(r.loops) == 2]
    assert inner and "4 iterations" in inner[0].loops[0] and "2 iterations" in inner[0].loops[1]
    assert {r.backward for r in inner} == {False, True}

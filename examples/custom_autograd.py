"""Autocast and custom autograd functions: ``jax.custom_vjp`` under ``jamp.autocast``.

PyTorch's "Autocast and Custom Autograd Functions" example::

    class MyMM(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cuda")
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a.mm(b)

        @staticmethod
        @torch.amp.custom_bwd(device_type="cuda")
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return grad.mm(b.t()), a.t().mm(grad)

    class MyFloat32Func(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
        def forward(ctx, input): ...

    with torch.autocast(device_type="cuda", dtype=torch.float16):
        output = MyMM.apply(input1, input2)
        with torch.autocast(device_type="cuda", enabled=False):  # a float32 region
            precise = torch.mm(output.float(), weight)
        out = MyFloat32Func.apply(precise)

The JAX analogue of an autograd ``Function`` is ``jax.custom_vjp``. Called
inside ``jamp.autocast``, its primal, ``fwd`` and ``bwd`` are interpreted
with autocast's rules, as ``custom_fwd``/``custom_bwd`` run the forward and
backward passes under the surrounding autocast state: ``mymm``'s products
run in float16, forward and backward. A region forced to float32 is a
function marked ``@jamp.autocast(enabled=False)`` (float16 inputs are cast back
first, which torch leaves to ``.float()``). ``custom_fwd(cast_inputs=
torch.float32)`` is ``@jamp.autocast(enabled=False)`` stacked over
``@jax.custom_vjp``: ``float32_func.defvjp`` still works, and its forward and
backward passes run in float32.

The script trains a small regression model made of the three pieces with
``jamp.loss_scaling``, reads from the compiled program which dtype each
piece's products ran in (forward and backward), and compares the gradients
with the float32 run. ``python examples/custom_autograd.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jex_core

import jamp


# MyMM: a custom matrix product; under autocast its products run in float16.
@jax.custom_vjp
def mymm(a, b):
    return a @ b


def mymm_fwd(a, b):
    return a @ b, (a, b)  # ctx.save_for_backward(a, b)


def mymm_bwd(res, grad):
    a, b = res
    return grad @ b.T, a.T @ grad


mymm.defvjp(mymm_fwd, mymm_bwd)


# torch.autocast(enabled=False) inside the region: everything here runs in float32.
@jamp.autocast(enabled=False)
def precise_mm(c, d):
    return c @ d


# MyFloat32Func, custom_fwd(cast_inputs=torch.float32): the marker over the custom_vjp.
@jamp.autocast(enabled=False)
@jax.custom_vjp
def float32_func(x, w):
    return jnp.tanh(x @ w)


def float32_func_fwd(x, w):
    y = jnp.tanh(x @ w)
    return y, (x, w, y)


def float32_func_bwd(res, grad):
    x, w, y = res
    dz = grad * (1 - y**2)
    return dz @ w.T, x.T @ dz


float32_func.defvjp(float32_func_fwd, float32_func_bwd)

PIECES = ("mymm", "precise_mm", "float32_func")


def model(params, x):
    with jax.named_scope("mymm"):
        h = jax.nn.relu(mymm(x, params["w1"]))  # float16 under autocast
    with jax.named_scope("precise_mm"):
        a = precise_mm(h, params["w2"])  # h cast back to float32 first
    with jax.named_scope("float32_func"):
        b = float32_func(h, params["w3"])  # likewise: cast_inputs=torch.float32
    return (a + b) @ params["w4"]


def loss_fn(params, x, y):
    return jnp.mean((model(params, x) - y) ** 2)


def _equations(jaxpr):
    if isinstance(jaxpr, jex_core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
                    yield from _equations(sub)


def product_dtypes(fun, *args) -> dict:
    """``{piece: {"forward": dtypes, "backward": dtypes}}`` of the matrix products of ``fun``."""
    out = {piece: {"forward": set(), "backward": set()} for piece in PIECES}
    for eqn in _equations(jax.make_jaxpr(fun)(*args)):
        if eqn.primitive.name != "dot_general":
            continue
        stack = str(eqn.source_info.name_stack)
        for piece in PIECES:
            if piece in stack:
                side = "backward" if "transpose(" in stack else "forward"
                out[piece][side].add(str(eqn.outvars[0].aval.dtype))
    return {p: {side: sorted(d) for side, d in sides.items()} for p, sides in out.items()}


def init(key, features, hidden):
    ks = jax.random.split(key, 4)
    shapes = [(features, hidden), (hidden, hidden), (hidden, hidden), (hidden, 1)]
    return {
        f"w{i + 1}": jax.random.normal(k, s) / jnp.sqrt(float(s[0]))
        for i, (k, s) in enumerate(zip(ks, shapes, strict=True))
    }


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=32)
    args = parser.parse_args(argv)

    kx, kp = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (128, args.features))
    y = jnp.sin(x[:, :1]) + 0.5 * x[:, 1:2]
    params = init(kp, args.features, args.hidden)
    loss_f16 = jamp.autocast(loss_fn, jnp.float16)  # with torch.autocast("cuda", torch.float16)

    dtypes = product_dtypes(jax.grad(loss_f16), params, x, y)
    g16, g32 = jax.jit(jax.grad(loss_f16))(params, x, y), jax.jit(jax.grad(loss_fn))(params, x, y)
    grad_error = max(
        float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        for a, b in zip(jax.tree.leaves(g16), jax.tree.leaves(g32), strict=True)
    )

    tx = jamp.loss_scaling(optax.sgd(0.05, momentum=0.9))
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state):
        ls = jamp.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: jamp.scale(ls, loss_f16(p, x, y)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss / ls.scale

    losses = []
    for _ in range(args.steps):
        params, opt_state, loss = train_step(params, opt_state)
        losses.append(float(loss))
    for piece, sides in dtypes.items():
        print(f"{piece:13s} forward {sides['forward']}, backward {sides['backward']}")
    print(f"float16 gradients vs float32: relative error {grad_error:.2e}")
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; {jax.device_get(jamp.metrics(opt_state))}")
    return {"dtypes": dtypes, "grad_error": grad_error, "losses": losses}


if __name__ == "__main__":
    main()

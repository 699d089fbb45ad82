"""Programs as PyTorch users write them: their mistakes, data parallelism, batch statistics.

Each test runs the shape of a real training program (a jitted iteration, a
data-parallel step on the 8 test devices, a Flax model with batch
statistics), with the mistake a PyTorch user makes in it, and checks that
jamp refuses it with PyTorch's words and the call to write, or computes what
one device would.
"""

import dataclasses
import gc
import pickle
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _autocast_helpers import eqns_named
from jax.sharding import PartitionSpec as P

import jamp

N_DEV = 8


def loss_fn(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def problem(batch=32):
    k1, k2, kx = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w1": jax.random.normal(k1, (4, 8)) / 2, "w2": jax.random.normal(k2, (8, 1)) / 2}
    x = jax.random.normal(kx, (batch, 4))
    return params, x, jnp.sin(x[:, :1])


def leaves_close(a, b, atol=1e-6):
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(np.allclose(np.asarray(u), np.asarray(v), atol=atol, rtol=0) for u, v in pairs)


# ================================================================ 1. GradScaler misuse

SCALER = jamp.GradScaler(init_scale=2.0**10)
TX = optax.sgd(0.1, momentum=0.9)
CLIP = optax.clip_by_global_norm(1.0)


def run(iteration, steps=2):
    """A torch-style loop: ``for input, target in data: ...`` over a jitted iteration."""
    params, x, y = problem()
    state, opt_state = SCALER.init(), TX.init(params)
    for _ in range(steps):
        state, params, opt_state = jax.jit(iteration)(state, params, opt_state, x, y)
    return state, params, opt_state


def scaled_grads(state, params, x, y):  # scaler.scale(loss).backward()
    return jax.grad(lambda p: SCALER.scale(state, loss_fn(p, x, y)))(params)


def test_the_ported_loop_unscales_once_clips_steps_and_updates():
    """torch: scale(loss).backward(); unscale_(opt); clip_grad_norm_; step(opt); update()."""

    def iteration(state, params, opt_state, x, y):
        grads = scaled_grads(state, params, x, y)
        grads, state = SCALER.unscale(state, grads)
        grads, _ = CLIP.update(grads, CLIP.init(grads))
        params, opt_state, state = SCALER.step(state, TX, grads, opt_state, params)
        return SCALER.update(state), params, opt_state

    state, params, _ = run(iteration, steps=1)
    p0, x, y = problem()
    grads = jax.grad(loss_fn)(p0, x, y)
    grads, _ = CLIP.update(grads, CLIP.init(grads))
    expected = optax.apply_updates(p0, TX.update(grads, TX.init(p0), p0)[0])
    assert leaves_close(params, expected)  # unscaled once, not 1024 times smaller
    assert state.stage == "ready" and int(state.growth_tracker) == 1


def test_unscale_then_step_with_the_state_from_before_unscale_is_refused():
    """The issue's program: ``grads, found_inf = scaler.unscale(state, grads)``, clip, then
    ``scaler.step(state, ...)``: it silently unscaled a second time."""

    def iteration(state, params, opt_state, x, y):
        grads = scaled_grads(state, params, x, y)
        grads, found_inf = SCALER.unscale(state, grads)
        grads, _ = CLIP.update(grads, CLIP.init(grads))
        params, opt_state, new_state = SCALER.step(state, TX, grads, opt_state, params)
        return SCALER.update(new_state), params, opt_state

    with pytest.raises(
        RuntimeError,
        match=r"^unscale_\(\) has already been called since the last update\(\), so `grads` are "
        r"unscaled already.*write `grads, state = scaler\.unscale\(state, grads\)`",
    ):
        run(iteration)


def test_the_old_found_inf_keyword_says_the_state_records_it():
    def iteration(state, params, opt_state, x, y):
        grads, found_inf = SCALER.unscale(state, scaled_grads(state, params, x, y))
        params, opt_state, found_inf = SCALER.step(
            state, TX, grads, opt_state, params, found_inf=found_inf
        )
        return SCALER.update(state, found_inf), params, opt_state

    with pytest.raises(TypeError, match=r"`GradScaler\.step` takes no `found_inf`.*unscale"):
        run(iteration)


def test_update_given_the_flag_step_used_to_return_says_it_takes_none():
    def iteration(state, params, opt_state, x, y):
        grads = scaled_grads(state, params, x, y)
        params, opt_state, found_inf = SCALER.step(state, TX, grads, opt_state, params)
        return SCALER.update(state, found_inf), params, opt_state

    with pytest.raises(
        TypeError,
        match=r"`GradScaler\.update` takes no `found_inf`.*state = scaler\.update\(state\)",
    ):
        run(iteration)


@pytest.mark.parametrize("threaded", [True, False], ids=["state passed on", "same state"])
def test_unscaling_twice_is_refused_in_torchs_words(threaded):
    def iteration(state, params, opt_state, x, y):
        grads = scaled_grads(state, params, x, y)
        grads, unscaled = SCALER.unscale(state, grads)
        grads, unscaled = SCALER.unscale(unscaled if threaded else state, grads)
        params, opt_state, state = SCALER.step(unscaled, TX, grads, opt_state, params)
        return SCALER.update(state), params, opt_state

    with pytest.raises(
        RuntimeError,
        match=r"^unscale_\(\) has already been called on this optimizer since the last "
        r"update\(\)\.",
    ):
        run(iteration)


def test_update_twice_is_refused_in_torchs_words():
    def iteration(state, params, opt_state, x, y):
        grads = scaled_grads(state, params, x, y)
        params, opt_state, state = SCALER.step(state, TX, grads, opt_state, params)
        state = SCALER.update(state)
        state = SCALER.update(state)  # scaler.update() twice
        return state, params, opt_state

    with pytest.raises(
        RuntimeError, match=r"^No inf checks were recorded prior to update\..*scaler\.step"
    ):
        run(iteration)


def test_update_without_a_step_is_refused_in_torchs_words():
    """The optimizer stepped by hand (``optimizer.step()``), then ``scaler.update()``."""

    def iteration(state, params, opt_state, x, y):
        grads = jamp.unscale(state, scaled_grads(state, params, x, y))
        updates, opt_state = TX.update(grads, opt_state, params)
        return SCALER.update(state), optax.apply_updates(params, updates), opt_state

    with pytest.raises(RuntimeError, match=r"^No inf checks were recorded prior to update\."):
        run(iteration)


def test_stepping_twice_with_one_state_is_refused_in_torchs_words():
    """Two optimizers, each given the iteration's first state: the first check would be lost."""

    def iteration(state, params, opt_state, x, y):
        grads = scaled_grads(state, params, x, y)
        p0, o0, s0 = SCALER.step(state, TX, grads, opt_state, params)
        p1, o1, s1 = SCALER.step(state, TX, grads, opt_state, params)
        return SCALER.update(s1), p1, o1

    with pytest.raises(
        RuntimeError,
        match=r"^step\(\) has already been called since the last update\(\)\..*"
        r"params, opt_state, state = scaler\.step",
    ):
        run(iteration)


def test_the_update_result_passed_on_and_the_old_state_stepped_again_is_refused():
    def iteration(state, params, opt_state, x, y):
        grads = scaled_grads(state, params, x, y)
        params, opt_state, stepped = SCALER.step(state, TX, grads, opt_state, params)
        SCALER.update(stepped)  # torch habit: the result is dropped
        return SCALER.update(stepped), params, opt_state

    with pytest.raises(RuntimeError, match=r"^update\(\) has already been called with this state"):
        run(iteration)


def test_two_optimizers_one_unscaled_as_in_torchs_example():
    """torch: unscale_(opt0); step(opt0); step(opt1); update()."""
    tx1 = optax.sgd(0.05)

    @jax.jit
    def iteration(state, params, opt_state, opt_state1, x, y):
        g0 = scaled_grads(state, params, x, y)
        g1 = jax.tree.map(lambda g: g.at[0].set(jnp.inf), g0)  # only model 1 overflows
        g0, state = SCALER.unscale(state, g0)
        g0, _ = CLIP.update(g0, CLIP.init(g0))
        p0, opt_state, state = SCALER.step(state, TX, g0, opt_state, params)
        p1, opt_state1, state = SCALER.step(state, tx1, g1, opt_state1, params)
        return SCALER.update(state), state.found_infs, p0, p1

    params, x, y = problem()
    state, found_infs, p0, p1 = iteration(
        SCALER.init(), params, TX.init(params), tx1.init(params), x, y
    )
    assert [bool(f) for f in found_infs] == [False, True]
    assert not leaves_close(p0, params) and leaves_close(p1, params, atol=0)
    assert float(state.scale) == 2.0**9  # one backoff for the iteration, as in torch


def forgot_update(state, params, opt_state, x, y, tx=TX):
    """torch's typical loop without ``scaler.update()``: the state goes on as step left it."""
    grads = scaled_grads(state, params, x, y)
    params, opt_state, state = SCALER.step(state, tx, grads, opt_state, params)
    return state, params, opt_state


FORGOT_UPDATE = (
    r"^step\(\) has already been called since the last update\(\)\..*"
    r"state = scaler\.update\(state\)"
)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_forgetting_update_is_refused_in_torchs_words(jit):
    """torch raises on the second ``scaler.step(optimizer)``; the state carried on had kept
    the scale frozen, piled up inf checks and retraced the jitted step every iteration."""
    iteration = jax.jit(forgot_update) if jit else forgot_update
    params, x, y = problem()
    state, p1, opt_state = iteration(SCALER.init(), params, TX.init(params), x, y)
    assert not leaves_close(p1, params)  # the first iteration ran
    with pytest.raises(RuntimeError, match=FORGOT_UPDATE):
        iteration(state, p1, opt_state, x, y)


def test_forgetting_update_with_an_optimizer_made_in_the_step_never_retraces():
    """``optax.sgd(...)`` written inside the jitted step is a new transformation per trace:
    the state that comes back in is refused when the step is traced again, not retraced."""
    traces = []

    @jax.jit
    def iteration(state, params, opt_state, x, y):
        traces.append(state.stage)
        return forgot_update(state, params, opt_state, x, y, tx=optax.sgd(0.1, momentum=0.9))

    params, x, y = problem()
    state, params, opt_state = iteration(SCALER.init(), params, TX.init(params), x, y)
    with pytest.raises(RuntimeError, match=r"recorded in another trace.*retrace on every call"):
        iteration(state, params, opt_state, x, y)
    assert traces == ["ready", "stepped"]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_one_optax_optimizer_for_two_models_of_one_shape_chains_as_two_torch_optimizers(jit):
    """torch's multiple-models example with ``tx = optax.sgd(...)`` written once for both
    models (an Optax transformation is stateless): two steps, one update, per iteration."""

    def iteration(state, ps, opt_states, x, y):
        g0, g1 = jax.grad(
            lambda ps: SCALER.scale(state, loss_fn(ps[0], x, y) + 2 * loss_fn(ps[1], x, y))
        )(ps)
        p0, o0, state = SCALER.step(state, TX, g0, opt_states[0], ps[0])
        p1, o1, state = SCALER.step(state, TX, g1, opt_states[1], ps[1])
        return SCALER.update(state), (p0, p1), (o0, o1)

    iteration = jax.jit(iteration) if jit else iteration
    params, x, y = problem()
    ps = (params, jax.tree.map(lambda a: -a, params))
    state, opt_states = SCALER.init(), (TX.init(ps[0]), TX.init(ps[1]))
    for _ in range(3):
        state, ps, opt_states = iteration(state, ps, opt_states, x, y)
    assert state.stage == "ready" and int(state.growth_tracker) == 3


def test_a_gan_iteration_steps_d_then_scales_gs_loss_with_the_stepped_state():
    """torch's DCGAN with AMP: scale(errD).backward(); step(optD); scale(errG).backward();
    step(optG); update(). One transformation serves both models."""
    params, x, y = problem()
    gen = {"g": jnp.ones((4, 4)) / 4}

    @jax.jit
    def iteration(state, disc, gen, o_d, o_g):
        fake = lambda gen: x @ gen["g"]  # noqa: E731
        g_d = jax.grad(lambda d: SCALER.scale(state, loss_fn(d, fake(gen), y)))(disc)
        disc, o_d, state = SCALER.step(state, TX, g_d, o_d, disc)
        g_g = jax.grad(lambda g: SCALER.scale(state, -loss_fn(disc, fake(g), y)))(gen)
        gen, o_g, state = SCALER.step(state, TX, g_g, o_g, gen)
        return SCALER.update(state), disc, gen, o_d, o_g

    carry = (SCALER.init(), params, gen, TX.init(params), TX.init(gen))
    for _ in range(2):
        carry = iteration(*carry)
    assert carry[0].stage == "ready" and int(carry[0].growth_tracker) == 2


def test_a_new_array_at_the_address_of_a_freed_returned_one_is_not_taken_for_it():
    """The record of a step refers to the arrays it returned weakly, not by ``id``: once
    one is freed, CPython gives its id to the next array allocated, which a set of ids took
    for a returned one, refusing a second model's step ("step() has already been
    called")."""
    params, x, y = problem()
    state, opt_state = SCALER.init(), TX.init(params)
    grads = scaled_grads(state, params, x, y)
    returned, opt_state, state = SCALER.step(state, TX, grads, opt_state, params)
    freed = {id(a) for a in jax.tree.leaves(returned)}
    del returned
    gc.collect()
    # CPython gives a freed address to a later object of the same size, usually the next
    # one; jax's own threads may take it first (on a loaded machine, jax 0.12). Every
    # candidate is held, so each new one takes another free address until one is freed's.
    other, held = None, []
    for _ in range(20_000):
        candidate = jax.tree.map(lambda a: a + 1.0, params)  # another model, of one shape
        if any(id(a) in freed for a in jax.tree.leaves(candidate)):
            other = candidate
            break
        held.append(candidate)
    del held
    assert other is not None, "no new array took a freed array's id"
    assert not any(r() is not None for r in state.checked_by[0].outputs)  # all freed
    _, _, state = SCALER.step(state, TX, grads, opt_state, other)  # two models, one tx
    assert len(state.found_infs) == 2 and state.stage == "stepped"


def test_stepping_one_model_twice_in_an_iteration_is_refused_in_torchs_words():
    def iteration(state, params, opt_state, x, y):
        grads = scaled_grads(state, params, x, y)
        params, opt_state, state = SCALER.step(state, TX, grads, opt_state, params)
        params, opt_state, state = SCALER.step(state, TX, grads, opt_state, params)
        return SCALER.update(state), params, opt_state

    with pytest.raises(RuntimeError, match=r"^step\(\) has already been called.*This `tx`"):
        run(iteration)


def test_dropping_the_state_step_returns_is_refused():
    """``params, opt_state, _ = scaler.step(state, ...)``, then ``scaler.update(state)``."""

    def iteration(state, params, opt_state, x, y):
        grads = scaled_grads(state, params, x, y)
        params, opt_state, _ = SCALER.step(state, TX, grads, opt_state, params)
        return SCALER.update(state), params, opt_state

    with pytest.raises(
        RuntimeError, match=r"^No inf checks were recorded.*already passed to `scaler\.step`"
    ):
        run(iteration)


def forgot_update_and_dropped_the_state(state, params, opt_state, x, y):
    """Issue #35: no ``scaler.update``, and the state ``step`` returned dropped: the loop
    carries the state it was given, which ``step`` took."""
    grads = jax.grad(lambda p: SCALER.scale(state, loss_fn(p, x, y) * 1e38))(params)  # inf
    params, opt_state, _ = SCALER.step(state, TX, grads, opt_state, params)
    return state, params, opt_state


STALE = (
    r"^step\(\) has already been called since the last update\(\)\. This state was already "
    r"passed to `scaler\.step` in another trace.*scale would never change.*"
    r"dataclasses\.replace\(state\)"
)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_forgetting_update_and_dropping_the_state_step_returned_is_refused(jit):
    """The scale stayed at 2**10 through every overflowing step, with no error, when the
    iteration was jitted: it started each call from the same ready state, which nothing
    told from a fresh one. The state ``step`` took now leaves the trace marked (pytree
    metadata), so the next call retraces, and its ``step`` refuses it."""
    iteration = forgot_update_and_dropped_the_state
    if jit:
        iteration = jax.jit(iteration)
    params, x, y = problem()
    state, p1, opt_state = iteration(SCALER.init(), params, TX.init(params), x, y)
    assert leaves_close(p1, params, atol=0)  # the overflowing step was skipped
    assert float(state.scale) == 2.0**10 and state.consumed_by == "step"
    match = STALE if jit else r"^step\(\) has already been called.*clone it first"
    with pytest.raises(RuntimeError, match=match):
        iteration(state, p1, opt_state, x, y)
    # On purpose, a copy is a new, unconsumed state (a tree_map clone only within the trace)
    copied = dataclasses.replace(state)
    assert copied.consumed_by is None
    assert jax.tree.structure(copied) == jax.tree.structure(SCALER.init())
    _, p2, _ = iteration(copied, p1, opt_state, x, y)
    assert leaves_close(p2, params, atol=0)


def test_a_state_consumed_in_a_trace_is_cloned_there_and_refused_as_a_scan_carry():
    """Within the trace that consumed it, a clone is a new, unconsumed object (a step
    replayed); carried out of a ``lax.scan`` body, the consumed state is a carry of
    another structure, which jax refuses, naming the mark."""
    params, x, y = problem()

    @jax.jit
    def replayed(state, params, opt_state):
        grads = scaled_grads(state, params, x, y)
        p1, _, _ = SCALER.step(state, TX, grads, opt_state, params)
        clone = jax.tree_util.tree_map(lambda a: a, state)
        p2, _, stepped = SCALER.step(clone, TX, grads, opt_state, params)
        return SCALER.update(stepped), p1, p2

    state, p1, p2 = replayed(SCALER.init(), params, TX.init(params))
    assert leaves_close(p1, p2, atol=0) and state.consumed_by is None
    assert int(state.growth_tracker) == 1

    def body(carry, _):
        return forgot_update_and_dropped_the_state(*carry, x, y), None

    with pytest.raises(TypeError, match=r"carry.*consumed by scaler\.step: pass on the state"):
        jax.lax.scan(body, (SCALER.init(), params, TX.init(params)), None, length=3)


def test_a_jitted_loop_that_updates_traces_once_and_a_stale_state_pickles():
    """The mark changes nothing for a loop that passes on the state ``update`` returned;
    a stale state pickles (without its trace) and comes back consumed."""
    traces = []

    @jax.jit
    def iteration(state, params, opt_state):
        traces.append(state.stage)
        grads = scaled_grads(state, params, x, y)
        params, opt_state, state = SCALER.step(state, TX, grads, opt_state, params)
        return SCALER.update(state), params, opt_state

    params, x, y = problem()
    carry = (SCALER.init(), params, TX.init(params))
    for _ in range(3):
        carry = iteration(*carry)
    assert traces == ["ready"] and int(carry[0].growth_tracker) == 3
    stale, _, _ = jax.jit(forgot_update_and_dropped_the_state)(carry[0], *carry[1:], x, y)
    back = pickle.loads(pickle.dumps(stale))
    assert back.consumed_by == "step" and float(back.scale) == float(stale.scale)


def test_a_consumed_state_is_marked_openly_and_a_clone_of_it_is_usable():
    """The guard is a declared field, ``GradScalerState.consumed_by``, no leaf;
    its error says how to reuse a state on purpose: clone it (flatten, unflatten)."""
    params, x, y = problem()
    state, opt_state = SCALER.init(), TX.init(params)
    grads = scaled_grads(state, params, x, y)
    p1, _, stepped = SCALER.step(state, TX, grads, opt_state, params)
    assert (state.consumed_by, stepped.consumed_by) == ("step", None)
    # Not a leaf, and consumed eagerly not metadata either: a jitted step given either state
    # compiles the same program (consumed while traced, it is: the test above).
    assert jax.tree.structure(state) == jax.tree.structure(SCALER.init())
    with pytest.raises(
        RuntimeError,
        match=r"^step\(\) has already been called.*clone it first: "
        r"`state = jax\.tree_util\.tree_map\(lambda x: x, state\)`",
    ):
        SCALER.step(state, TX, grads, opt_state, params)
    clone = jax.tree_util.tree_map(lambda x: x, state)
    assert clone.consumed_by is None
    p2, _, replayed = SCALER.step(clone, TX, grads, opt_state, params)  # the step, replayed
    assert leaves_close(p2, p1, atol=0) and replayed.stage == "stepped"
    assert clone.consumed_by == "step"


def test_a_plain_loss_scale_state_has_no_stage_and_is_never_consumed():
    """As GradScalerState's docstring says: each method takes a plain state as a ready one."""
    params, x, y = problem()
    plain, opt_state = jamp.dynamic_loss_scale(2.0**10), TX.init(params)
    grads = scaled_grads(plain, params, x, y)
    p1, _, stepped = SCALER.step(plain, TX, grads, opt_state, params)
    p2, _, _ = SCALER.step(plain, TX, grads, opt_state, params)
    assert leaves_close(p1, p2, atol=0) and type(stepped) is jamp.GradScalerState
    assert not hasattr(plain, "consumed_by")


# ================================================================ 2. calls written the torch way


def test_scaler_methods_called_without_the_state_say_it_comes_first():
    params, x, y = problem()
    loss = loss_fn(params, x, y)
    calls = {
        r"scaler\.scale\(state, loss\)": lambda: SCALER.scale(loss),  # scaler.scale(loss)
        r"state = scaler\.update\(state\)": lambda: SCALER.update(),  # scaler.update()
        r"params, opt_state, state = scaler\.step\(state, tx": lambda: SCALER.step(TX),
        r"grads, state = scaler\.unscale\(state, grads\)": lambda: SCALER.unscale(TX),
        r"scaler\.get_scale\(state\)": lambda: SCALER.get_scale(),
        r"scaler\.state_dict\(state\)": lambda: SCALER.state_dict(),
    }
    for fix, call in calls.items():
        with pytest.raises(TypeError, match=r"takes the scaler's state first.*" + fix):
            call()


@pytest.mark.parametrize(
    "call",
    [
        lambda: jamp.autocast(device_type="cuda", dtype=jnp.float16),
        lambda: jamp.autocast("cuda", dtype=jnp.float16),
        lambda: jamp.autocast("cpu"),
        lambda: jamp.autocast(dtype=jnp.bfloat16),
        lambda: jamp.autocast(jnp.float16),
    ],
    ids=["device_type=", "'cuda'", "'cpu'", "dtype only", "a dtype"],
)
def test_autocast_as_a_context_manager_says_it_wraps_a_function(call):
    def forward(params, x):
        with call():  # with torch.autocast(device_type="cuda", dtype=torch.float16):
            return loss_fn(params, x, x[:, :1])

    params, x, _ = problem()
    with pytest.raises(TypeError, match=r"wraps a function.*jamp\.autocast\(fn, jnp\.float16\)"):
        jax.jit(forward)(params, x)


def dot_dtypes(fun, *args):
    """The output dtype of every matrix product ``fun`` runs, backward pass included."""
    jaxpr = jax.make_jaxpr(fun)(*args)
    return [str(e.outvars[0].aval.dtype) for e in eqns_named(jaxpr, "dot_general")]


def test_autocast_as_a_decorator_is_written_as_torchs():
    """``@torch.autocast(device_type="cuda", dtype=torch.bfloat16)`` on a forward: the dtype
    by name (keyword-only, as eqx.filter_jit takes its options), or the defaults."""
    params, x, _ = problem()

    @jamp.autocast(dtype=jnp.float16)
    def forward(params, x):
        return jnp.tanh(x @ params["w1"]) @ params["w2"]

    @jamp.autocast()
    def default(params, x):
        return x @ params["w1"]

    assert dot_dtypes(forward, params, x) == ["float16", "float16"]
    assert dot_dtypes(default, params, x) == ["bfloat16"]
    assert forward(params, x).dtype == jnp.float32  # the dtype the function returns
    with pytest.raises(ValueError, match=r"float16 or bfloat16 for `dtype`.*got float32"):
        jamp.autocast(dtype=jnp.float32)  # checked where the decorator is written


def test_autocast_disabled_as_a_decorator_or_a_call():
    """``@torch.autocast(device_type="cuda", enabled=False)`` on a helper inside an autocast
    region; ``with jamp.autocast(enabled=False):`` names the decorator to write."""

    @jamp.autocast(enabled=False)
    def gram(x):
        return x @ x.T

    gram2 = jamp.autocast(lambda x: x @ x.T, enabled=False)
    f = jamp.autocast(lambda x: gram(x) + gram2(x) + x @ x.T)
    assert dot_dtypes(f, jnp.ones((2, 2))) == ["float32", "float32", "bfloat16"]
    with pytest.raises(
        TypeError, match=r"not a context manager.*jamp\.autocast\(fn, enabled=False\)"
    ):
        with jamp.autocast(enabled=False):
            pass


def custom_gram(outer_disabled):
    """torch's ``custom_fwd``/``custom_bwd`` example as a jax.custom_vjp: x @ x.T."""

    def gram(x):
        return x @ x.T

    def fwd(x):
        return x @ x.T, x

    def bwd(x, ct):
        return (ct @ x + ct.T @ x,)

    if outer_disabled:  # @jamp.autocast(enabled=False) over @jax.custom_vjp, then .defvjp
        gram = jamp.autocast(jax.custom_vjp(gram), enabled=False)
    else:  # @jax.custom_vjp over @jamp.autocast(enabled=False)
        gram = jax.custom_vjp(jamp.autocast(gram, enabled=False))
    gram.defvjp(fwd, bwd)
    return gram


@pytest.mark.parametrize("outer_disabled", [True, False], ids=["disabled outer", "vjp outer"])
def test_autocast_disabled_stacked_with_custom_vjp_in_either_order(outer_disabled):
    gram = custom_gram(outer_disabled)
    x = jnp.arange(4.0).reshape(2, 2)
    loss = jamp.autocast(lambda x: jnp.sum(gram(x)), jnp.float16)
    grads = jax.grad(loss)(x)
    np.testing.assert_allclose(grads, jax.grad(lambda x: jnp.sum(x @ x.T))(x))
    fwd_and_bwd = dot_dtypes(jax.grad(loss), x)
    if outer_disabled:  # the whole custom_vjp, its fwd and bwd, runs as written
        assert set(fwd_and_bwd) == {"float32"}
    else:  # only the primal is marked: fwd and bwd are autocast
        assert "float16" in fwd_and_bwd


def test_jamp_scale_given_the_optimizer_state_points_to_get_loss_scale():
    params, x, y = problem()
    tx = jamp.loss_scaling(optax.sgd(0.1))

    @jax.jit
    def train_step(params, opt_state):
        grads = jax.grad(lambda p: jamp.scale(opt_state, loss_fn(p, x, y)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    with pytest.raises(
        TypeError,
        match=r"`jamp\.scale`.*got ScaledOptimizerState.*jamp\.get_loss_scale\(opt_state\)",
    ):
        train_step(params, tx.init(params))


def test_step_with_params_and_opt_state_swapped_says_which_is_which():
    def iteration(state, params, opt_state, x, y):
        grads = scaled_grads(state, params, x, y)
        params, opt_state, state = SCALER.step(state, TX, grads, params, opt_state)
        return SCALER.update(state), params, opt_state

    with pytest.raises(
        TypeError,
        match=r"`opt_state` shaped like the gradients.*look swapped.*"
        r"scaler\.step\(state, tx, grads, opt_state, params\)",
    ):
        run(iteration)


# ================================================================ 3. data parallelism

BAD_STEP, BAD_DEVICE = 1, 5


def batches(steps=3):
    """A global batch per step; at BAD_STEP, a NaN in BAD_DEVICE's shard only."""
    params, x, y = problem()
    xs = [x * (1 + 0.1 * t) for t in range(steps)]
    per_device = x.shape[0] // N_DEV
    xs[BAD_STEP] = xs[BAD_STEP].at[BAD_DEVICE * per_device, 0].set(jnp.nan)
    return params, xs, y


def one_device(front):
    """The reference: every step on one device, with the same front end."""
    params, xs, y = batches()
    tx, step = single_step(front)
    opt_state = tx.init(params)
    skipped = []
    for x in xs:
        params, opt_state, skip = jax.jit(step)(params, opt_state, x, y)
        skipped.append(bool(skip))
    return params, skipped


def single_step(front, axis_name=None, reduce=lambda g: g, loss_divisor=lambda: 1):
    """A train step written once; the styles differ in axis_name, reduce and the divisor."""
    if front == "loss_scaling":
        tx = jamp.loss_scaling(optax.sgd(0.1, momentum=0.9), axis_name=axis_name)

        def step(params, opt_state, x, y):
            ls = jamp.get_loss_scale(opt_state)
            scaled = lambda p: jamp.scale(ls, loss_fn(p, x, y) / loss_divisor())  # noqa: E731
            grads = reduce(jax.grad(scaled)(params))
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, ~opt_state.last_finite

        return tx, step

    scaler = jamp.GradScaler(axis_name=axis_name)
    inner = optax.sgd(0.1, momentum=0.9)

    class Both:  # (optimizer state, scaler state) travel together
        @staticmethod
        def init(params):
            return inner.init(params), scaler.init()

    def step(params, both, x, y):
        opt_state, state = both
        scaled = lambda p: scaler.scale(state, loss_fn(p, x, y) / loss_divisor())  # noqa: E731
        grads = reduce(jax.grad(scaled)(params))
        params, opt_state, state = scaler.step(state, inner, grads, opt_state, params)
        found_inf = scaler.found_inf(state)
        return params, (opt_state, scaler.update(state)), found_inf

    return Both, step


FRONTS = ["loss_scaling", "GradScaler"]


@pytest.mark.parametrize("front", FRONTS)
def test_jit_with_an_explicit_mesh_computes_what_one_device_does(front):
    """``jax.make_mesh`` in explicit mode and ``jax.set_mesh``: the batch sharded, the
    parameters replicated, no axis_name; XLA averages, the check is global."""
    assert len(jax.devices()) == N_DEV
    reference, ref_skipped = one_device(front)
    params, xs, y = batches()
    tx, step = single_step(front)
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    skipped = []
    with jax.set_mesh(mesh):
        params = jax.device_put(params, P())
        opt_state = jax.device_put(tx.init(params), P())
        y = jax.device_put(y, P("data"))
        for x in xs:
            x = jax.device_put(x, P("data"))
            params, opt_state, skip = jax.jit(step)(params, opt_state, x, y)
            skipped.append(bool(skip))
    assert skipped == ref_skipped == [t == BAD_STEP for t in range(len(xs))]
    assert leaves_close(params, reference)
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(params))


@pytest.mark.parametrize("front", FRONTS)
def test_shard_map_sums_replicated_gradients_so_the_recipe_divides_the_loss(front):
    """Under shard_map (check_vma on, the default) the gradient of a replicated parameter
    comes back already summed over the axis: the recipe divides each shard's loss by the
    axis size. A pmean would change nothing (the gradient is no longer per-device) and a
    psum would multiply it by the axis size again."""
    reference, ref_skipped = one_device(front)
    params, xs, y = batches()
    tx, step = single_step(front, axis_name="data", loss_divisor=lambda: jax.lax.axis_size("data"))
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data")),
            out_specs=(P(), P(), P()),
        )
    )
    opt_state = tx.init(params)
    skipped = []
    for x in xs:
        params, opt_state, skip = sharded(params, opt_state, x, y)
        skipped.append(bool(skip))
    assert skipped == ref_skipped
    assert leaves_close(params, reference)

    # The claim behind the recipe, checked: without the division the gradient is N_DEV
    # times one device's; pmean leaves it so, psum multiplies it again.
    p0, x, y = problem()

    def local(reduce):
        return lambda p, x, y: reduce(jax.grad(loss_fn)(p, x, y))

    def grads(reduce):
        specs = dict(in_specs=(P(), P("data"), P("data")), out_specs=P())
        return jax.jit(jax.shard_map(local(reduce), mesh=mesh, **specs))(p0, x, y)

    full = jax.grad(loss_fn)(p0, x, y)
    times_n = jax.tree.map(lambda g: g * N_DEV, full)
    assert leaves_close(grads(lambda g: g), times_n, atol=1e-5)
    assert leaves_close(grads(lambda g: jax.lax.pmean(g, "data")), times_n, atol=1e-5)
    psum = grads(lambda g: jax.lax.psum(g, "data"))
    assert leaves_close(psum, jax.tree.map(lambda g: g * N_DEV, times_n), atol=1e-4)


def replicate(tree):
    return jax.tree.map(lambda a: jnp.stack([a] * N_DEV), tree)


def per_device(a):
    return a.reshape(N_DEV, -1, *a.shape[1:])


@pytest.mark.parametrize("front", FRONTS)
def test_pmap_with_pmean_computes_what_one_device_does(front):
    """``jax.pmap``: axis_name agrees on skipping; the pmean averages the gradients."""
    reference, ref_skipped = one_device(front)
    params, xs, y = batches()
    tx, step = single_step(front, axis_name="data", reduce=lambda g: jax.lax.pmean(g, "data"))
    pstep = jax.pmap(step, axis_name="data")
    params, opt_state = replicate(params), replicate(tx.init(params))
    skipped = []
    for x in xs:
        params, opt_state, skip = pstep(params, opt_state, per_device(x), per_device(y))
        assert np.all(np.asarray(skip) == np.asarray(skip)[0])  # one decision everywhere
        skipped.append(bool(skip[0]))
    assert skipped == ref_skipped
    assert leaves_close(jax.tree.map(lambda a: a[0], params), reference)
    assert leaves_close(jax.tree.map(lambda a: a[-1], params), reference)


@pytest.mark.parametrize("front", FRONTS)
def test_axis_name_alone_does_not_average_a_flax_port_trains_on_its_own_shard(front):
    """flax's ``DynamicScale(axis_name=...)`` averaged the gradients; jamp's axis_name only
    agrees on skipping. A port that drops the pmean runs without error, every device on its
    own shard's gradients, and the replicas drift apart."""
    reference, _ = one_device(front)
    params, xs, y = batches()
    tx, step = single_step(front, axis_name="data")  # no pmean
    pstep = jax.pmap(step, axis_name="data")
    params, opt_state = replicate(params), replicate(tx.init(params))
    for x in xs:
        params, opt_state, skip = pstep(params, opt_state, per_device(x), per_device(y))
        assert np.all(np.asarray(skip) == np.asarray(skip)[0])  # skipping is still agreed
    first = jax.tree.map(lambda a: a[0], params)
    last = jax.tree.map(lambda a: a[-1], params)
    assert not leaves_close(first, last, atol=1e-3)
    assert not leaves_close(first, reference, atol=1e-3)


# ================================================================ 4. batch statistics


def linen_problem():
    from flax import linen as nn
    from flax.training import train_state

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.Dense(16)(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            return nn.Dense(1)(nn.relu(x))

    class TrainState(train_state.TrainState):
        batch_stats: Any

    model = Net()
    variables = model.init(jax.random.PRNGKey(0), jnp.ones((4, 3)), train=False)
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=jamp.loss_scaling(optax.sgd(0.1)),
    )
    return model, state


@pytest.mark.parametrize("recipe", [True, False], ids=["recipe", "no recipe"])
def test_a_skipped_step_keeps_linen_batch_stats_with_the_recipe(recipe):
    """flax's imagenet example: a float16 forward overflows, the step is skipped, and the
    batch statistics the forward pass updated are kept anyway, inf and all."""
    model, state = linen_problem()
    forward = jamp.autocast(model.apply, jnp.float16)

    @jax.jit
    def train_step(state, x, y):
        ls = jamp.get_loss_scale(state.opt_state)

        def scaled_loss(params):
            variables = {"params": params, "batch_stats": state.batch_stats}
            out, updates = forward(variables, x, train=True, mutable=["batch_stats"])
            return jamp.scale(ls, jnp.mean((out - y) ** 2)), updates["batch_stats"]

        grads, batch_stats = jax.grad(scaled_loss, has_aux=True)(state.params)
        new = state.apply_gradients(grads=grads)
        if recipe:
            batch_stats = jamp.compat.select_tree(
                new.opt_state.last_finite, batch_stats, state.batch_stats
            )
        return new.replace(batch_stats=batch_stats)

    x, y = jnp.ones((8, 3)), jnp.zeros((8, 1))
    state = train_step(state, x, y)
    assert bool(state.opt_state.last_finite)
    before = state.batch_stats
    state = train_step(state, x.at[0, 0].set(1e5), y)  # overflows float16
    assert not bool(state.opt_state.last_finite)
    finite = all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(state.batch_stats))
    assert finite == recipe
    if recipe:
        assert leaves_close(state.batch_stats, before, atol=0)
        state = train_step(state, x, y)  # and training goes on
        assert bool(state.opt_state.last_finite)


@pytest.mark.parametrize("recipe", [True, False], ids=["recipe", "no recipe"])
def test_a_skipped_step_keeps_nnx_batchnorm_statistics_with_the_recipe(recipe):
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(3, 16, rngs=rngs)
            self.bn = nnx.BatchNorm(16, rngs=rngs)
            self.out = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.bn(self.dense(x))))

    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jamp.loss_scaling(optax.sgd(0.1)), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        before = nnx.as_pure(nnx.state(model, nnx.BatchStat))  # a copy: nnx.state is live
        ls = jamp.get_loss_scale(optimizer)
        grads = nnx.grad(lambda m: jamp.scale(ls, jnp.mean((m(x) - y) ** 2)))(model)
        optimizer.update(model, grads)
        if recipe:
            finite = jamp.metrics(optimizer)["last_finite"]
            after = nnx.as_pure(nnx.state(model, nnx.BatchStat))
            nnx.update(model, jamp.compat.select_tree(finite, after, before))

    x, y = jnp.ones((8, 3)), jnp.zeros((8, 1))
    train_step(model, optimizer, x, y)
    before = np.asarray(model.bn.mean[...])
    train_step(model, optimizer, x.at[0, 0].set(jnp.inf), y)
    assert not bool(jamp.metrics(optimizer)["last_finite"])
    kept = np.array_equal(np.asarray(model.bn.mean[...]), before)
    assert kept == recipe
    assert bool(jnp.all(jnp.isfinite(model.bn.mean[...]))) == recipe


def test_an_optimizer_that_makes_its_own_nan_is_not_caught():
    """README's promise has this limit: the gradients are finite, the update is not."""
    params = {"w": jnp.ones(2)}
    tx = jamp.loss_scaling(optax.adam(1e-3, eps=0.0))
    opt_state = tx.init(params)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int32 and float32
        updates, opt_state = tx.update({"w": jnp.zeros(2)}, opt_state, params)
    assert bool(opt_state.last_finite) and bool(jnp.all(jnp.isnan(updates["w"])))

"""The optimizer recipes' per-device memory under FSDP, on the 8 virtual CPU devices
(issue #45): each device holds its share of the state, and 8-bit moments shard even
where a leaf's blocks of 256 would not divide over the mesh.

The state is measured after one jitted update step (its sharding follows the
parameters'), as the bytes of the shards on one device: ``addressable_shards``' nbytes.
docs/scaling-out.md's table is this test's figures.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jamp
from jamp.optimizer import BlockQuantized

BF16 = jnp.bfloat16
N_DEV = 8


def adamw():
    return optax.adamw(2.0**-10)


def lp(moments):
    return jamp.low_precision_state(adamw(), dtypes={"mu": moments, "nu": moments})


# recipe: (parameter dtype, optimizer)
RECIPES = {
    "adamw, float32 parameters": (jnp.float32, adamw),
    "exact masters": (BF16, lambda: jamp.master_weights(adamw())),
    "Kahan masters": (BF16, lambda: jamp.master_weights(adamw(), rounding="kahan")),
    "stochastic + bf16 moments": (
        BF16,
        lambda: jamp.master_weights(lp(BF16), rounding="stochastic"),
    ),
    "stochastic + 8-bit moments": (
        BF16,
        lambda: jamp.master_weights(lp("8bit"), rounding="stochastic"),
    ),
}
# bytes per parameter on each of 8 devices: (parameters and state, state alone)
EXPECTED = {
    "adamw, float32 parameters": (12.0, 8.0),
    "exact masters": (12.0, 10.0),
    "Kahan masters": (12.0, 10.0),
    "stochastic + bf16 moments": (6.0, 4.0),
    "stochastic + 8-bit moments": (4.03, 2.03),
}
ROWS, COLS = 1024, 256  # the model: one kernel, P("data", None), 1,024 blocks of 256


def mesh():
    return Mesh(np.array(jax.devices()), ("data",))


def on_device(tree, device):
    """The bytes of ``tree``'s shards on ``device``."""
    return sum(
        s.data.nbytes
        for a in jax.tree.leaves(tree)
        for s in a.addressable_shards
        if s.device == device
    )


def one_step(tx, params):
    @jax.jit
    def step(params, state):
        grads = jax.tree.map(lambda p: (p * 0.5 + 0.25).astype(p.dtype), params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step(params, jax.jit(tx.init)(params))


def fsdp(values):
    sharding = NamedSharding(mesh(), P("data", None))
    return {k: jax.device_put(v, sharding) for k, v in values.items()}


@pytest.fixture(scope="module")
def kernel():
    rng = np.random.default_rng(45)
    return rng.uniform(-1.0, 1.0, (ROWS, COLS)).astype(np.float32)


@pytest.mark.standard_promotion  # optax.adamw
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_keeps_a_share_of_its_state_per_device(kernel, recipe):
    dtype, make = RECIPES[recipe]
    params, state = one_step(make(), fsdp({"w": jnp.asarray(kernel, dtype)}))
    assert len(jax.devices()) == N_DEV
    n = kernel.size // N_DEV  # the parameters on one device
    device = jax.devices()[0]
    both = (on_device(params, device) + on_device(state, device)) / n
    alone = on_device(state, device) / n
    # bytes per parameter on a device, of its 32,768 parameters: the recipe's figure on
    # one device, plus replicated scalars (counts) and, for exact and Kahan, the
    # fingerprint of 256 elements
    assert both == pytest.approx(EXPECTED[recipe][0], abs=0.01), (recipe, both)
    assert alone == pytest.approx(EXPECTED[recipe][1], abs=0.01), (recipe, alone)
    total = sum(a.nbytes for a in jax.tree.leaves(state))
    assert alone * n == pytest.approx(total / N_DEV, rel=0.01), "the state is not sharded"


@pytest.mark.standard_promotion  # optax.adamw
def test_8bit_moments_shard_where_their_blocks_do_not_divide_over_the_mesh():
    # 72 x 64 = 4,608 elements: 18 blocks of 256, which do not divide over 8. The block
    # count is padded to 24 (a multiple of 8, the largest power of two dividing 72), so
    # XLA shards the blocks: 3 a device, where 18 unpadded would be replicated on all 8.
    rng = np.random.default_rng(46)
    w = rng.uniform(-1.0, 1.0, (72, 64)).astype(np.float32)
    tx = jamp.master_weights(lp("8bit"), rounding="stochastic")
    params, state = one_step(tx, fsdp({"w": jnp.asarray(w, BF16)}))
    moments = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, BlockQuantized))]
    moments = [m for m in moments if isinstance(m, BlockQuantized)]
    assert len(moments) == 2
    device = jax.devices()[0]
    for m in moments:
        assert m.codes.shape == (24, 256) and m.absmax.shape == (24,)
        assert on_device(m, device) == (24 * 256 + 24 * 4) // N_DEV  # 780 bytes, not 4,680
        assert m.codes.sharding.is_equivalent_to(NamedSharding(mesh(), P("data", None)), 2)

    # the same step unsharded, on one device: the same bits (the blocks are of the whole
    # array, not of each device's rows, and stochastic rounding hashes global indices)
    one = jax.devices()[0]
    params1, state1 = one_step(tx, {"w": jax.device_put(jnp.asarray(w, BF16), one)})
    for a, b in zip(
        jax.tree.leaves((params, state)), jax.tree.leaves((params1, state1)), strict=True
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()

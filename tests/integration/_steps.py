"""The training step the distributed tests and their worker process share (not a test
module): ``tx``'s update of the gradients of ``loss_fn`` scaled by ``tx``'s loss scale,
jitted. The worker imports it by name from its own folder, as the tests do."""

import jax
import optax

import jamp


def make_step(tx, loss_fn):
    @jax.jit
    def step(params, opt_state, x, y):
        ls = jamp.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: jamp.scale(ls, loss_fn(p, x, y)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step

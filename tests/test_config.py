"""check_config, the one validation of a loss-scale configuration (via the state's constructors)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp

BAD_CTOR = [
    (
        dict(init_scale=0.0),
        ValueError,
        r"`init_scale` to be positive and finite, got init_scale=0\.0",
    ),
    (dict(init_scale=-1.0), ValueError, r"init_scale=-1\.0"),
    (dict(init_scale=math.inf), ValueError, r"init_scale=inf"),
    (dict(init_scale=math.nan), ValueError, r"init_scale=nan"),
    (dict(init_scale=1e39), ValueError, r"`init_scale` within \[min_scale, max_scale\]"),
    (dict(init_scale=2.0**127), ValueError, r"init_scale=1\.7"),
    (dict(init_scale=1.0, min_scale=2.0), ValueError, r"init_scale=1\.0"),
    (dict(init_scale="big"), TypeError, r"`init_scale` to be a real number, got 'big'"),
    (dict(init_scale=np.float16(4.0)), TypeError, r"`init_scale`.*dtype float16"),
    (dict(init_scale=jnp.asarray(4.0, jnp.bfloat16)), TypeError, r"`init_scale`.*dtype bfloat16"),
    (
        dict(init_scale=jnp.ones(2)),
        ValueError,
        r"`init_scale` to be a scalar, got an array of shape \(2,\)",
    ),
    (
        dict(growth_factor=1.0),
        ValueError,
        r"`growth_factor` > 1 and finite, got growth_factor=1\.0",
    ),
    (dict(growth_factor=0.5), ValueError, r"growth_factor=0\.5"),
    (dict(growth_factor=math.inf), ValueError, r"growth_factor=inf"),
    (
        dict(backoff_factor=1.0),
        ValueError,
        r"`backoff_factor` in the open interval \(0, 1\), got backoff_factor=1\.0",
    ),
    (dict(backoff_factor=0.0), ValueError, r"backoff_factor=0\.0"),
    (dict(backoff_factor=-0.5), ValueError, r"backoff_factor=-0\.5"),
    (dict(growth_interval=0), ValueError, r"`growth_interval`.*growth_interval=0"),
    (dict(growth_interval=-1), ValueError, r"growth_interval=-1"),
    (
        dict(growth_interval=2.5),
        TypeError,
        r"`growth_interval` to be an integer >= 1, got growth_interval=2\.5",
    ),
    (dict(growth_interval=True), TypeError, r"growth_interval=True"),
    (dict(growth_interval=2**31), ValueError, r"growth_interval=2147483648"),
    (
        dict(min_scale=4.0, max_scale=2.0, init_scale=3.0),
        ValueError,
        r"`min_scale` <= `max_scale`, got min_scale=4\.0 > max_scale=2\.0",
    ),
    (dict(min_scale=0.0), ValueError, r"`min_scale` in \[2\*\*-126, 2\*\*126\].*min_scale=0\.0"),
    (dict(max_scale=2.0**127), ValueError, r"`max_scale` in \[2\*\*-126, 2\*\*126\]"),
    (dict(hysteresis=0), ValueError, r"`hysteresis` to be an integer >= 1, got hysteresis=0"),
    (dict(hysteresis=1.5), TypeError, r"hysteresis=1\.5"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_CTOR)
def test_dynamic_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        jamp.dynamic_loss_scale(**kwargs)


@pytest.mark.parametrize(
    "value,exc,match",
    [
        (0.0, ValueError, r"`scale` to be positive and finite, got scale=0\.0"),
        (math.inf, ValueError, r"scale=inf"),
        (2.0**127, ValueError, r"`scale` within"),
        ("1", TypeError, r"`scale` to be a real number"),
    ],
)
def test_static_validation(value, exc, match):
    with pytest.raises(exc, match=match):
        jamp.static_loss_scale(value)


def test_validation_rejects_tracers():
    with pytest.raises(TypeError, match=r"`init_scale`.*traced value"):
        jax.jit(lambda x: jamp.dynamic_loss_scale(x))(jnp.float32(2.0))

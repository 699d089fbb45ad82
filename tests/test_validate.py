"""check_config, the one validation of a loss-scale configuration (via the state's constructors)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _bad_input import assert_clear_error

import jamp

DYN = jamp.dynamic_loss_scale
STATIC = jamp.static_loss_scale

# Every invalid configuration of the loss-scale constructors: id -> (call, exception,
# match). A tuple of patterns: each must match (two tables checked that call).
BAD_INPUT = {
    # dynamic_loss_scale: init_scale
    "init_scale=0": (
        lambda: DYN(0.0),
        ValueError,
        (
            r"`init_scale`.*init_scale=0\.0",
            r"`init_scale` to be positive and finite, got init_scale=0\.0",
        ),
    ),
    "init_scale=-1": (
        lambda: DYN(-1.0),
        ValueError,
        (r"`init_scale`.*init_scale=-1\.0", r"init_scale=-1\.0"),
    ),
    "init_scale=inf": (
        lambda: DYN(math.inf),
        ValueError,
        (r"`init_scale`.*init_scale=inf", r"init_scale=inf"),
    ),
    "init_scale=nan": (
        lambda: DYN(math.nan),
        ValueError,
        (r"`init_scale`.*init_scale=nan", r"init_scale=nan"),
    ),
    "init_scale=1e39": (
        lambda: DYN(1e39),
        ValueError,
        r"`init_scale` within \[min_scale, max_scale\]",
    ),
    "init_scale=2**127": (lambda: DYN(init_scale=2.0**127), ValueError, r"init_scale=1\.7"),
    "init_scale>max_scale": (
        lambda: DYN(2.0**20, max_scale=2.0**10),
        ValueError,
        r"`init_scale` within",
    ),
    "init_scale<min_scale": (
        lambda: DYN(1.0, min_scale=2.0),
        ValueError,
        (r"`init_scale` within", r"init_scale=1\.0"),
    ),
    "init_scale=str": (lambda: DYN("1024"), TypeError, r"`init_scale` to be a real number"),
    "init_scale='big'": (
        lambda: DYN(init_scale="big"),
        TypeError,
        r"`init_scale` to be a real number, got 'big'",
    ),
    "init_scale=None": (lambda: DYN(None), TypeError, r"`init_scale` to be a real number"),
    "init_scale=True": (lambda: DYN(True), TypeError, r"`init_scale` to be a real number"),
    "init_scale=complex": (lambda: DYN(1 + 1j), TypeError, r"`init_scale` to be a real number"),
    "init_scale=float16": (
        lambda: DYN(jnp.float16(1024)),
        TypeError,
        r"`init_scale`.*dtype float16",
    ),
    "init_scale=bfloat16": (
        lambda: DYN(jnp.asarray(1024, jnp.bfloat16)),
        TypeError,
        r"`init_scale`.*dtype bfloat16",
    ),
    "init_scale=bfloat16(4)": (
        lambda: DYN(init_scale=jnp.asarray(4.0, jnp.bfloat16)),
        TypeError,
        r"`init_scale`.*dtype bfloat16",
    ),
    "init_scale=np.float16": (
        lambda: DYN(np.float16(1024)),
        TypeError,
        r"`init_scale`.*dtype float16",
    ),
    "init_scale=np.float16(4)": (
        lambda: DYN(init_scale=np.float16(4.0)),
        TypeError,
        r"`init_scale`.*dtype float16",
    ),
    "init_scale=vector": (
        lambda: DYN(jnp.ones(2)),
        ValueError,
        (
            r"`init_scale` to be a scalar.*\(2,\)",
            r"`init_scale` to be a scalar, got an array of shape \(2,\)",
        ),
    ),
    "init_scale=bool array": (
        lambda: DYN(jnp.asarray(True)),
        TypeError,
        r"`init_scale`.*dtype bool",
    ),
    # dynamic_loss_scale: the update rule's configuration
    "growth_factor=1": (
        lambda: DYN(growth_factor=1.0),
        ValueError,
        (
            r"`growth_factor` > 1.*growth_factor=1\.0",
            r"`growth_factor` > 1 and finite, got growth_factor=1\.0",
        ),
    ),
    "growth_factor=0.5": (lambda: DYN(growth_factor=0.5), ValueError, r"growth_factor=0\.5"),
    "growth_factor=inf": (lambda: DYN(growth_factor=math.inf), ValueError, r"growth_factor=inf"),
    "growth_factor=nan": (lambda: DYN(growth_factor=math.nan), ValueError, r"growth_factor=nan"),
    "growth_factor=str": (
        lambda: DYN(growth_factor="2"),
        TypeError,
        r"`growth_factor` to be a real number",
    ),
    "backoff_factor=0": (
        lambda: DYN(backoff_factor=0.0),
        ValueError,
        (r"`backoff_factor`.*backoff_factor=0\.0", r"backoff_factor=0\.0"),
    ),
    "backoff_factor=1": (
        lambda: DYN(backoff_factor=1.0),
        ValueError,
        (
            r"backoff_factor=1\.0",
            r"`backoff_factor` in the open interval \(0, 1\), got backoff_factor=1\.0",
        ),
    ),
    "backoff_factor=-0.5": (lambda: DYN(backoff_factor=-0.5), ValueError, r"backoff_factor=-0\.5"),
    "backoff_factor=nan": (lambda: DYN(backoff_factor=math.nan), ValueError, r"backoff_factor=nan"),
    "growth_interval=0": (
        lambda: DYN(growth_interval=0),
        ValueError,
        r"`growth_interval`.*growth_interval=0",
    ),
    "growth_interval=-5": (lambda: DYN(growth_interval=-5), ValueError, r"growth_interval=-5"),
    "growth_interval=-1": (lambda: DYN(growth_interval=-1), ValueError, r"growth_interval=-1"),
    "growth_interval=2**31": (
        lambda: DYN(growth_interval=2**31),
        ValueError,
        r"growth_interval=2147483648",
    ),
    "growth_interval=2.0": (lambda: DYN(growth_interval=2.0), TypeError, r"growth_interval=2\.0"),
    "growth_interval=2.5": (
        lambda: DYN(growth_interval=2.5),
        TypeError,
        r"`growth_interval` to be an integer >= 1, got growth_interval=2\.5",
    ),
    "growth_interval=True": (
        lambda: DYN(growth_interval=True),
        TypeError,
        r"growth_interval=True",
    ),
    "hysteresis=0": (
        lambda: DYN(hysteresis=0),
        ValueError,
        (r"`hysteresis`.*hysteresis=0", r"`hysteresis` to be an integer >= 1, got hysteresis=0"),
    ),
    "hysteresis=1.5": (lambda: DYN(hysteresis=1.5), TypeError, r"hysteresis=1\.5"),
    # dynamic_loss_scale: the bounds
    "min_scale=0": (
        lambda: DYN(min_scale=0.0),
        ValueError,
        (
            r"`min_scale`.*min_scale=0\.0",
            r"`min_scale` in \[2\*\*-126, 2\*\*126\].*min_scale=0\.0",
        ),
    ),
    "max_scale=inf": (lambda: DYN(max_scale=math.inf), ValueError, r"`max_scale`.*max_scale=inf"),
    "max_scale=2**127": (
        lambda: DYN(max_scale=2.0**127),
        ValueError,
        (r"`max_scale`", r"`max_scale` in \[2\*\*-126, 2\*\*126\]"),
    ),
    "min_scale>max_scale": (
        lambda: DYN(min_scale=4.0, max_scale=2.0),
        ValueError,
        r"min_scale=4\.0 > max_scale=2\.0",
    ),
    "min_scale>max_scale, init_scale=3": (
        lambda: DYN(min_scale=4.0, max_scale=2.0, init_scale=3.0),
        ValueError,
        r"`min_scale` <= `max_scale`, got min_scale=4\.0 > max_scale=2\.0",
    ),
    "min_scale=str": (lambda: DYN(min_scale="x"), TypeError, r"`min_scale` to be a real number"),
    # static_loss_scale
    "static scale=0": (
        lambda: STATIC(0.0),
        ValueError,
        (r"`scale`.*scale=0\.0", r"`scale` to be positive and finite, got scale=0\.0"),
    ),
    "static scale=-1": (lambda: STATIC(-1.0), ValueError, r"scale=-1\.0"),
    "static scale=inf": (lambda: STATIC(math.inf), ValueError, r"scale=inf"),
    "static scale=nan": (lambda: STATIC(math.nan), ValueError, r"scale=nan"),
    "static scale=2**127": (lambda: STATIC(2.0**127), ValueError, r"`scale` within"),
    "static scale=str": (lambda: STATIC("1"), TypeError, r"`scale` to be a real number"),
    "static scale=float16": (
        lambda: STATIC(jnp.float16(8)),
        TypeError,
        r"`scale`.*dtype float16",
    ),
    "static scale=bfloat16": (
        lambda: STATIC(jnp.asarray(8, jnp.bfloat16)),
        TypeError,
        r"`scale`.*dtype bfloat16",
    ),
    # issue #26: numbers past float64's range name the argument (were a bare OverflowError)
    "init_scale=10**400": (
        lambda: DYN(10**400),
        ValueError,
        r"`init_scale` to be a finite number within float32's range, got an integer of 401",
    ),
    "growth_factor=10**400": (lambda: DYN(growth_factor=10**400), ValueError, r"`growth_factor`"),
    "backoff_factor=-10**400": (
        lambda: DYN(backoff_factor=-(10**400)),
        ValueError,
        r"`backoff_factor`",
    ),
    "min_scale=10**400": (lambda: DYN(min_scale=10**400), ValueError, r"`min_scale`"),
    "growth_interval=10**400": (
        lambda: DYN(growth_interval=10**400),
        ValueError,
        r"`growth_interval` to be an integer in \[1, 2\*\*31 - 1\].*\(401 characters\)",
    ),
    "static scale=10**400": (lambda: STATIC(10**400), ValueError, r"`scale`"),
    # issue #26: a growth factor the scale could never grow by (1e300 was accepted)
    "growth_factor=1e300": (
        lambda: DYN(growth_factor=1e300),
        ValueError,
        (r"`growth_factor` <= max_scale / min_scale", r"would stop growing"),
    ),
    "growth_factor=2**20 with bounds [1, 2**16]": (
        lambda: DYN(1.0, growth_factor=2.0**20, min_scale=1.0, max_scale=2.0**16),
        ValueError,
        r"`growth_factor` <= max_scale / min_scale = 65536\.0, got growth_factor=1048576",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    assert_clear_error(*BAD_INPUT[case])


def test_validation_rejects_tracers():
    # Raised inside jit's trace by design, so not a BAD_INPUT entry.
    with pytest.raises(TypeError, match=r"`init_scale`.*traced value"):
        jax.jit(lambda x: jamp.dynamic_loss_scale(x))(jnp.float32(2.0))


def test_an_integer_scale_is_accepted_as_a_number_as_check_config_says():
    """check_config's docstring and code agree (issue #26): an integer scale, a Python int
    or an integer 0-d array, is a number; float16, complex and bool arrays are refused."""
    for scale in (1024, np.int64(1024), jnp.int32(1024), np.uint16(1024)):
        assert float(DYN(scale).scale) == 1024.0
        assert float(STATIC(scale).scale) == 1024.0
    for bad in (jnp.float16(8), np.complex64(8), np.bool_(True)):
        with pytest.raises(TypeError, match=r"`init_scale`"):
            DYN(bad)


def test_a_factor_up_to_the_whole_range_is_accepted_and_grows_the_scale():
    state = DYN(1.0, growth_factor=2.0**16, growth_interval=1, min_scale=1.0, max_scale=2.0**16)
    assert float(jamp.update(state, jnp.bool_(True)).scale) == 2.0**16
    pinned = DYN(4.0, growth_factor=1e30, min_scale=4.0, max_scale=4.0)  # cannot move anyway
    assert float(jamp.update(pinned, jnp.bool_(True)).scale) == 4.0
    with pytest.raises(ValueError, match=r"`growth_factor` <= .*3[.]40282"):
        DYN(4.0, growth_factor=1e300, min_scale=4.0, max_scale=4.0)  # past float32

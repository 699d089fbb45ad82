"""Every script in examples/ runs, on tiny sizes, and does what it says."""

import importlib.util
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]  # tests/<folder>/this file
EXAMPLES = ROOT / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def leaves_equal(a, b):
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(bool(jnp.array_equal(x, y)) for x, y in pairs)


def test_every_example_has_a_main_and_a_test():
    scripts = sorted(p.stem for p in EXAMPLES.glob("*.py"))
    text = pathlib.Path(__file__).read_text()
    for name in scripts:
        assert callable(getattr(load(name), "main", None)), name
        assert f'load("{name}")' in text, f"examples/{name}.py has no test"


def test_scale_one_loss():
    out = load("scale_one_loss").main(["--steps", "60", "--features", "4"])
    assert out["losses"][-1] < out["losses"][0] / 100
    m = out["metrics"]
    # The first steps overflow float16 at 2**16 and back off; nothing grows in 60 steps.
    assert m["skipped_steps"] == math.log2(65536.0 / m["loss_scale"]) >= 1
    np.testing.assert_allclose(out["params"]["w"], out["true_w"], atol=0.05)


def test_multiple_losses_sum_list_and_dict_agree():
    mod = load("multiple_losses")
    runs = {f: mod.main(["--steps", "30", "--form", f, "--hidden", "8"]) for f in mod.FORMS}
    for form in ("list", "dict"):
        assert leaves_equal(runs[form]["params"], runs["sum"]["params"]), form
    history = runs["sum"]["history"]
    assert history[-1][0] < history[0][0] / 2 and history[-1][1] < history[0][1] / 2
    # One update per iteration from both optimizers' flags: the scale backed off to where
    # float16 holds the gradients of both models.
    assert float(runs["sum"]["state"].scale) < 65536.0


def test_training_loop_over_epochs():
    out = load("training_loop").main(["--epochs", "3", "--batches", "15", "--features", "8"])
    losses = out["epoch_losses"]
    assert losses[-1] < losses[0] / 4
    last = out["checkpoints"][-1]
    keys = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    assert set(last) == keys
    # Every skipped step halved the scale once; growth_interval=2000 never fired.
    assert out["skipped"] == math.log2(65536.0 / last["scale"]) >= 1
    assert 0 < last["_growth_tracker"] <= 45 - out["skipped"]  # finite steps since the last skip


def test_near_zero_gradients_survive_only_with_scaling():
    out = load("near_zero_gradients").main(["--size", "16"])
    assert out["max_abs_float32_grad"] < float(jnp.finfo(jnp.float16).smallest_subnormal)
    assert out["float32"]["nonzero"] == 1.0
    assert out["float16"]["nonzero"] == 0.0  # all underflowed
    assert out["float16+scaling"]["nonzero"] == 1.0 and out["finite"]
    assert out["float16+scaling"]["relative_error"] < 1e-2


def test_cnn_clipping_after_unscaling_both_styles():
    mod = load("cnn_clipping")
    args = ["--steps", "12", "--batch-size", "32", "--max-norm", "0.5"]
    a = mod.main(args)
    b = mod.main(args + ["--style", "optax"])
    assert max(a["norms"]) > 0.5  # clipping was active (the unscaled norm, not the scaled one)
    assert max(a["clipped_norms"]) <= 0.5 * (1 + 1e-5)
    assert max(a["norms"]) < 1e3  # an unscaled norm: scaled gradients would be 2**16 larger
    for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"]), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6)
    assert np.mean(a["losses"][-3:]) < a["losses"][0]
    assert a["skipped"] == 0


@pytest.mark.standard_promotion  # optax.MultiSteps mixes int32 and float32 in its accumulator
def test_gradient_accumulation_with_multisteps():
    out = load("gradient_accumulation").main(
        ["--steps", "5", "--micro-steps", "3", "--micro-batch", "8", "--inject-inf-at", "4"]
    )
    records = out["records"]
    changed = [r["params_changed"] for r in records]
    # Parameters move only at step boundaries, except the step whose micro-batch 4 was inf.
    assert changed == [i % 3 == 2 and i != 5 for i in range(15)]
    scales = [r["scale"] for r in records]
    assert scales == [1024.0] * 5 + [512.0] * 10  # constant across micro-steps, backs off once
    assert [r["skipped_steps"] for r in records][-1] == 1  # later steps are not poisoned
    assert out["final_loss"] < out["initial_loss"]


def test_data_parallel_over_8_devices_and_on_1():
    assert len(jax.devices()) == 8  # tests/conftest.py
    mod = load("data_parallel")
    many = mod.main(["--steps", "20", "--per-device-batch", "4"])
    assert many["devices"] == 8 and len(many["batch_sharding"].device_set) == 8
    one = mod.main(["--steps", "20", "--global-batch", "32", "--devices", "1"])
    assert one["devices"] == 1
    # float16 partial sums are split differently over 8 devices than on 1.
    np.testing.assert_allclose(many["losses"], one["losses"], rtol=1e-2)
    assert np.mean(many["losses"][-5:]) < np.mean(many["losses"][:3]) / 2
    # A NaN on one device's shard skips the step on every device.
    poisoned = mod.main(["--steps", "6", "--per-device-batch", "4", "--nan-at-step", "3"])
    clean = mod.main(["--steps", "3", "--per-device-batch", "4"])
    assert 3 in poisoned["skipped_at"] and 3 not in one["skipped_at"]
    assert set(poisoned["skipped_at"]) - {3} == set(clean["skipped_at"])
    for leaf in jax.tree.leaves(poisoned["params"]):
        assert leaf.sharding.is_fully_replicated and bool(jnp.all(jnp.isfinite(leaf)))


def test_flax_train_state_loop():
    out = load("flax_train_state").main(["--steps", "60", "--log-every", "30"])
    assert np.mean(out["losses"][-5:]) < out["losses"][0] / 4
    assert [set(m) for m in out["logs"]] == [
        {"loss_scale", "growth_tracker", "last_finite", "skipped_steps"}
    ] * 2
    assert out["logs"][-1]["last_finite"] == 1.0


def test_nnx_loop():
    out = load("nnx_loop").main(["--steps", "60", "--log-every", "30"])
    assert np.mean(out["losses"][-5:]) < out["losses"][0] / 4
    assert out["logs"][-1]["last_finite"] == 1.0
    import jamp

    assert float(jamp.get_loss_scale(out["optimizer"]).scale) == out["logs"][-1]["loss_scale"]


@pytest.mark.standard_promotion  # the demo trains with optax.adam
def test_train_digits_demo(tmp_path, capsys):
    out = tmp_path / "plots" / "digits.png"
    # The scale doubles every step here, from 2**16, so it overflows float16 at step 20
    # (near 2**36): 24 steps see it, with the underflow measured at steps 0, 8 and 16.
    results = load("train_digits").main(
        ["--steps", "24", "--log-every", "8", "--out", str(out), "--no-progress"]
        + ["--growth-interval", "1"]
    )
    printed = capsys.readouterr().out
    for header in ("mode", "loss", "test acc", "skipped", "scale", "underflow", "ms/step"):
        assert header in printed
    for mode in ("float32", "float16", "float16+scaling", "bfloat16", "float8"):
        assert any(line.startswith(mode + " ") for line in printed.splitlines()), mode
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    by_mode = {r.mode: r for r in results}
    assert by_mode["float32"].underflow.max() == 0.0
    # Gradients normalised by 2**22 tokens underflow in float16 without scaling, not with it.
    assert by_mode["float16"].underflow[0] > 0.3
    assert by_mode["float16+scaling"].underflow[0] < 0.01
    # float8's per-tensor scales keep them without loss scaling, and it trains. What
    # float8_e5m2 still flushes (entries 2**16 below a tensor's largest) varies with the
    # batch: 0.08% to 2.6% of the first dense kernel's gradient at initialisation.
    assert np.mean(by_mode["float8"].underflow) < 0.01
    assert by_mode["float8"].underflow.max() < 0.05 < 0.3 < by_mode["float16"].underflow.min()
    assert by_mode["float8"].losses[-1] < by_mode["float8"].losses[0]
    scaled = by_mode["float16+scaling"]
    assert scaled.scales[0] == 2.0**17  # 65536, doubled after the first finite step
    # It overflows float16 at some point, skips that step and halves the scale.
    assert len(scaled.skipped_at) == scaled.skipped >= 1
    for i in scaled.skipped_at:
        assert scaled.scales[i] == scaled.scales[i - 1] / 2
    assert all(r.skipped == 0 for r in results if r.mode != "float16+scaling")
    assert by_mode["float32"].losses[-1] < by_mode["float32"].losses[0]


def test_train_digits_flags(tmp_path, capsys):
    mod = load("train_digits")
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    assert exc.value.code == 0
    printed = capsys.readouterr().out
    assert "--modes" in printed and "--growth-interval" in printed and "--init-scale" in printed
    with pytest.raises(SystemExit):
        mod.main(["--modes", "float4"])
    with pytest.raises(SystemExit):
        mod.main(["--growth-interval", "0"])


@pytest.mark.standard_promotion  # the example trains with optax.adam
def test_equinox_mlp_float16_with_scaling_and_an_injected_overflow(capsys):
    mod = load("equinox_mlp")
    args = ["--steps", "25", "--inject-inf-at", "3"]
    results = {r.mode: r for r in mod.main(args)}
    printed = capsys.readouterr().out
    for header in ("mode", "loss", "test acc", "skipped", "scale", "underflow"):
        assert header in printed
    # Gradients normalised by 2**22 tokens underflow in float16 without scaling, not with it.
    assert results["float32"].underflow == 0.0
    assert results["float16"].underflow > 0.5
    assert results["float16+scaling"].underflow < 0.01
    for r in results.values():
        # The injected inf: that step alone is skipped, and changes neither the model
        # nor the optimizer state; training goes on.
        assert [i for i, ok in enumerate(r.finite) if not ok] == [3], r.mode
        assert r.unchanged == {3: (True, True)}, r.mode
    scales = results["float16+scaling"].scales
    assert scales[2] == 65536.0 and scales[3] == 32768.0
    assert results["float32"].losses[-1] < results["float32"].losses[0]
    # The Optax style (jamp.loss_scaling) trains the same model.
    [other] = mod.main(args + ["--style", "optax", "--modes", "float16+scaling"])
    assert other.unchanged == {3: (True, True)} and np.array_equal(other.scales, scales)
    pairs = zip(
        jax.tree.leaves(results["float16+scaling"].model),
        jax.tree.leaves(other.model),
        strict=True,
    )
    for a, b in pairs:
        if isinstance(a, jax.Array):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_gradient_penalty_trains_and_skips_an_overflow_in_the_inner_gradient():
    out = load("gradient_penalty").main(["--steps", "30", "--hidden", "8", "--inject-inf-at", "20"])
    history = out["history"]
    assert history[20]["skipped"] and history[20]["scale"] == history[19]["scale"] / 2
    assert history[-1]["loss"] < history[0]["loss"] / 2
    assert history[-1]["penalty"] < history[0]["penalty"]


def test_custom_autograd_functions_run_in_the_dtypes_torch_gives_them():
    out = load("custom_autograd").main(["--steps", "40", "--hidden", "8"])
    both = lambda dtype: {"forward": [dtype], "backward": [dtype]}  # noqa: E731
    assert out["dtypes"] == {
        "mymm": both("float16"),  # custom_fwd / custom_bwd: the surrounding autocast
        "precise_mm": both("float32"),  # autocast(enabled=False) inside the region
        "float32_func": both("float32"),  # custom_fwd(cast_inputs=torch.float32)
    }
    assert out["grad_error"] < 1e-2
    assert out["losses"][-1] < out["losses"][0] / 4

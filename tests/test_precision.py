"""tfdist.precision: what --precision=auto picks on each device, and the refusals."""

import keras
import pytest

from tfdist import precision
from tfdist.errors import UserError


def test_tpu_gets_bfloat16():
    assert precision.choose("auto", device_kind="tpu").policy == "mixed_bfloat16"


def test_mixed_float16_on_tpu_is_refused():
    with pytest.raises(UserError, match="--precision=mixed_float16 cannot run on TPUs"):
        precision.choose("mixed_float16", device_kind="tpu")


@pytest.mark.parametrize("cc, policy", [((7, 0), "mixed_float16"), ((7, 5), "mixed_float16"),
                                        ((8, 0), "mixed_bfloat16"), ((9, 0), "mixed_bfloat16"), ((6, 1), "float32")])
def test_gpu_by_compute_capability(cc, policy):
    assert precision.choose("auto", device_kind="gpu", gpu_compute_capability=cc).policy == policy


def test_cpu_follows_bf16_instructions(monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: ["amx_bf16"])
    assert precision.choose("auto", device_kind="cpu").policy == "mixed_bfloat16"
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: [])
    assert precision.choose("auto", device_kind="cpu").policy == "float32"


def test_explicit_choice_wins_and_loss_scaling_only_for_float16():
    choice = precision.choose("mixed_float16", device_kind="gpu", gpu_compute_capability=(8, 0))
    assert choice.policy == "mixed_float16" and choice.loss_scaling
    assert not precision.choose("mixed_bfloat16", device_kind="cpu").loss_scaling


def test_apply_sets_policy_and_warns_for_float16_on_cpu(caplog):
    with caplog.at_level("WARNING"):
        precision.apply(precision.PrecisionChoice("mixed_float16", "test"), device_kind="cpu")
    assert keras.mixed_precision.dtype_policy().name == "mixed_float16"
    assert "mixed_float16 on a CPU is very slow" in caplog.text


# make_strategy and tfdist-train ----------------------------------------------------
def test_make_strategy_leaves_the_users_policy_unless_asked(monkeypatch):
    import tfdist

    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: ["avx512_bf16"])  # Where "auto" picks bfloat16.
    tfdist.make_strategy("default")
    assert keras.config.dtype_policy().name == "float32"  # Keras' default, as the user had it.
    users = keras.DTypePolicy("mixed_bfloat16")
    keras.config.set_dtype_policy(users)
    tfdist.make_strategy("default")
    assert keras.config.dtype_policy() is users  # The user's own policy object, not a new one.
    keras.config.set_dtype_policy("float32")
    tfdist.make_strategy("default", precision="auto")  # Asked: chosen for the device.
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    tfdist.make_strategy("default", precision="float32")
    assert keras.config.dtype_policy().name == "float32"


def test_a_kept_policy_is_reported_and_mixed_float16_kept_on_a_tpu_is_refused():
    keras.config.set_dtype_policy("mixed_bfloat16")
    kept = precision.choose(None, device_kind="cpu")
    assert (kept.policy, kept.reason) == ("mixed_bfloat16", precision.KEPT_REASON)
    keras.config.set_dtype_policy("mixed_float16")
    assert precision.choose(None, device_kind="gpu").loss_scaling
    with pytest.raises(UserError, match="^Keras' global dtype policy is mixed_float16, which cannot run on TPUs"):
        precision.choose(None, device_kind="tpu")


def test_tfdist_train_chooses_by_default_and_logs_the_choice(tmp_path):
    from tests.conftest import run_train
    from tfdist.mnist.config import TrainConfig

    assert TrainConfig().precision == "auto"
    expected = precision.choose("auto", device_kind="cpu")
    result = run_train([f"--workdir={tmp_path / 'w'}", "--max_steps=2", "--strategy=default"], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"precision={expected.policy} ({expected.reason})" in result.stderr, result.stderr[-2000:]

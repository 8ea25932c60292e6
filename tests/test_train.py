"""tfdist.mnist.train: the real loop on real digits, in this process.

Accuracy is measured on the 2,000 held-out bundled digits; equivalence tests
compare final weights of runs that must agree (replica count, accumulation,
steps per execution) in float32.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist

from tests.conftest import REPO, load_weights, subprocess_env
from tfdist.mnist import data, train
from tfdist.distribute import strategies
from tfdist.mnist.config import TrainConfig
from tfdist.errors import UserError


def run(tmp_path, name="run", **changes):
    config = TrainConfig(workdir=str(tmp_path / name), **changes)
    return train.train_and_evaluate(config)


def assert_evaluated(metrics, examples):
    """The evaluation itself counted `examples`, and the accuracy is a whole number of them right."""
    assert metrics["eval_examples"] == examples
    correct = metrics["eval_accuracy"] * examples
    assert abs(correct - round(correct)) < 1e-3, (correct, examples)


def test_defaults_reach_accuracy_and_fill_the_workdir(tmp_path):
    metrics = run(tmp_path)
    assert metrics["eval_accuracy"] >= 0.97
    assert_evaluated(metrics, 2000)
    assert (metrics["num_replicas"], metrics["num_workers"], metrics["steps"]) == (1, 1, 5 * 62)
    workdir = tmp_path / "run"
    assert sorted(os.listdir(workdir)) == ["checkpoints", "config.json", "flags.txt", "membership.json",
                                           "metrics.json", "model.keras", "plan.json", "tensorboard"]
    saved = json.loads((workdir / "metrics.json").read_text())
    for key in ("strategy", "num_replicas", "num_workers", "precision", "global_batch_size", "steps", "epochs",
                "eval_accuracy", "eval_loss", "train_examples_per_sec", "wall_seconds", "weights_fingerprint"):
        assert key in saved, key
    assert saved["weights_fingerprint"] == metrics["weights_fingerprint"]
    assert TrainConfig.from_dict(json.loads((workdir / "config.json").read_text())).workdir == str(workdir)
    assert tf.train.latest_checkpoint(str(workdir / "checkpoints")).endswith("ckpt-310")
    # The exported model gives the reported accuracy on the held-out digits.
    import keras

    model = keras.models.load_model(str(workdir / "model.keras"), compile=False)
    digits = data.load_dataset("mnist")
    predictions = np.argmax(model.predict(digits.eval_images, verbose=0), -1)
    assert np.mean(predictions == digits.eval_labels) == pytest.approx(metrics["eval_accuracy"], abs=2e-3)
    # TensorBoard got the scalars.
    tags = set()
    for event_file in tf.io.gfile.glob(str(workdir / "tensorboard" / "events.*")):
        for event in tf.compat.v1.train.summary_iterator(event_file):
            tags |= {v.tag for v in event.summary.value}
    assert {"train/loss", "train/accuracy", "train/learning_rate", "train/examples_per_sec",
            "eval/loss", "eval/accuracy"} <= tags


@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16"])
def test_precisions_reach_accuracy(tmp_path, precision):
    metrics = run(tmp_path, precision=precision)
    assert metrics["precision"] == precision and metrics["eval_accuracy"] >= 0.96


def test_mixed_float16_learns_with_loss_scaling(tmp_path):
    # float16 convolutions are emulated on CPUs (1.7 s a step at batch 32 here): few, small steps.
    metrics = run(tmp_path, precision="mixed_float16", strategy="mirrored", num_cpu_replicas=2,
                  max_steps=20, steps_per_execution=4, global_batch_size=32)
    assert metrics["precision"] == "mixed_float16"
    # Keras' initial scale, untouched: no step overflowed, and the scale grows only after 2000 finite steps.
    # A spurious overflow (a wrong finite check) halves it; 20 steps counted means none was skipped.
    assert (metrics["loss_scale"], metrics["steps"], metrics["step_counter"]) == (2.0 ** 15, 20, 20)
    assert metrics["last_train_loss"] <= metrics["first_train_loss"] / 2


def half_precision_model(initial_scale):
    half = keras.DTypePolicy("mixed_float16")  # Per layer: Keras' global policy stays as it is.
    model = keras.Sequential([
        keras.Input((28, 28, 1)), keras.layers.Flatten(dtype=half),
        keras.layers.Dense(32, activation="relu", dtype=half, kernel_initializer=keras.initializers.GlorotUniform(0)),
        keras.layers.Dense(10, dtype="float32", kernel_initializer=keras.initializers.GlorotUniform(1))])
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=initial_scale),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("replicas", [1, 2])
def test_loss_scaling_skips_overflowing_steps_and_halves_the_scale_as_keras_does(replicas):
    """At 2**20 the first step's float16 gradients overflow on one device: Keras skips it and halves the scale.

    With 2 replicas each replica's loss is half as large, so nothing overflows: the reference is then Keras'
    own model.fit under a 2-replica MirroredStrategy (measured: identical weights, 0.0 apart)."""
    full = data.load_dataset("mnist")
    batches = tf.data.Dataset.from_tensor_slices(
        (full.train_images[:1024].astype("float32") / 255.0, full.train_labels[:1024])).batch(64, drop_remainder=True)
    reference_strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"][:replicas],
                                                        cross_device_ops=tf.distribute.ReductionToOneDevice())
    with reference_strategy.scope():
        reference = half_precision_model(2.0 ** 20)
    expected = reference.fit(batches, epochs=1, verbose=0, shuffle=False).history
    skipped = 1 if replicas == 1 else 0
    assert float(reference.optimizer.dynamic_scale.numpy()) == 2.0 ** (20 - skipped)
    assert int(reference.optimizer.inner_optimizer.iterations.numpy()) == 16 - skipped
    name, options = ("default", {}) if replicas == 1 else ("mirrored", {"num_cpu_replicas": 2,
                                                                      "all_reduce": "reduce_to_one"})
    strategy = tfdist.make_strategy(name, precision="float32", **options)
    with strategy.scope():
        model = half_precision_model(2.0 ** 20)
    history = tfdist.fit(model, batches, epochs=1, verbose=0, strategy=strategy).history
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0 ** (20 - skipped)
    assert int(model.optimizer.inner_optimizer.iterations.numpy()) == 16 - skipped
    assert history["loss"][0] == pytest.approx(expected["loss"][0], abs=1e-5)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_mirrored_two_cpu_replicas_reach_accuracy(tmp_path):
    metrics = run(tmp_path, strategy="mirrored", num_cpu_replicas=2)
    assert metrics["num_replicas"] == 2 and metrics["eval_accuracy"] >= 0.97


def _weights_after(tmp_path, name, **changes):
    # Plain SGD: Adam's update ignores a constant factor on every gradient and would hide a wrong scale.
    run(tmp_path, name, precision="float32", max_steps=6, optimizer="sgd", learning_rate=0.1, **changes)
    return load_weights(str(tmp_path / name / "model.keras"))


def test_replicas_split_the_global_batch_without_changing_the_update(tmp_path):
    one = _weights_after(tmp_path, "one", strategy="default")
    two = _weights_after(tmp_path, "two", strategy="mirrored", num_cpu_replicas=2, all_reduce="reduce_to_one")
    # In one process, collective all-reduce groups of different sizes collide
    # (TensorFlow keys them per strategy instance); real runs have one strategy.
    four = _weights_after(tmp_path, "four", strategy="mirrored", num_cpu_replicas=4, all_reduce="reduce_to_one")
    for a, b, c in zip(one, two, four):
        np.testing.assert_allclose(a, b, atol=2e-5)
        np.testing.assert_allclose(a, c, atol=2e-5)


def test_gradient_accumulation_equals_the_full_batch(tmp_path):
    full = _weights_after(tmp_path, "full")
    accumulated = _weights_after(tmp_path, "accum", grad_accum_steps=4)
    for a, b in zip(full, accumulated):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_steps_per_execution_does_not_change_training(tmp_path):
    one = _weights_after(tmp_path, "spe1", steps_per_execution=1)
    five = _weights_after(tmp_path, "spe5", steps_per_execution=5)
    for a, b in zip(one, five):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_evaluation_counts_each_example_once_with_uneven_replicas(tmp_path):
    full = data.load_dataset("mnist")
    digits = data.Digits("subset", full.train_images[:960], full.train_labels[:960],
                         full.eval_images[:1001], full.eval_labels[:1001])
    config = TrainConfig(workdir=str(tmp_path / "w"), strategy="mirrored", num_cpu_replicas=3,
                         all_reduce="reduce_to_one", global_batch_size=96, epochs=1)
    metrics = train.train_and_evaluate(config, digits=digits)
    assert metrics["num_replicas"] == 3
    assert_evaluated(metrics, 1001)  # 1001 over 3 replicas: padded batches, each real example counted once.


def test_resuming_a_finished_run_trains_no_more(tmp_path):
    first = run(tmp_path, max_steps=20, checkpoint_every_steps=10)
    again = run(tmp_path, max_steps=20, checkpoint_every_steps=10)
    assert (again["resumed_from_step"], again["steps"]) == (20, 20)
    assert again["weights_fingerprint"] == first["weights_fingerprint"]
    # The restored weights were evaluated again, on every held-out digit, to the same result.
    assert_evaluated(again, 2000)
    assert again["eval_accuracy"] == first["eval_accuracy"]


def test_resume_continues_to_the_same_total(tmp_path):
    run(tmp_path, epochs=2, max_steps=30)  # Interrupted after 30 of 124 steps.
    metrics = run(tmp_path, epochs=2)
    assert (metrics["resumed_from_step"], metrics["steps"]) == (30, 124)


def _snapshot(directory):
    return {p: open(os.path.join(directory, p), "rb").read()
            for p in sorted(os.listdir(directory)) if os.path.isfile(os.path.join(directory, p))}


def test_noresume_never_overwrites(tmp_path):
    run(tmp_path, max_steps=10)
    workdir = tmp_path / "run"
    before = (_snapshot(workdir), _snapshot(workdir / "checkpoints"))
    with pytest.raises(UserError, match="already holds checkpoint ckpt-10 and resuming is off"):
        run(tmp_path, max_steps=10, resume=False)
    with pytest.raises(UserError, match=r"global_batch \(was 128, now 64\).*steps_per_epoch \(was 62, now 125\).*changed what a training step"):
        run(tmp_path, max_steps=10, global_batch_size=64)
    assert (_snapshot(workdir), _snapshot(workdir / "checkpoints")) == before


def test_resume_flag_without_checkpoint(tmp_path):
    with pytest.raises(UserError, match="--resume was given but .* holds no checkpoint"):
        run(tmp_path, resume=True)


def test_injected_backend_is_used(tmp_path):
    backend = strategies.build_backend(TrainConfig(strategy="mirrored", num_cpu_replicas=2))
    metrics = train.train_and_evaluate(TrainConfig(workdir=str(tmp_path / "w"), max_steps=4), backend=backend)
    assert metrics["strategy"] == "mirrored" and metrics["num_replicas"] == 2


def test_xla_trains_to_the_same_accuracy(tmp_path):
    plain = run(tmp_path, "plain", epochs=2, precision="float32", jit_compile="false")
    xla = run(tmp_path, "xla", epochs=2, precision="float32", jit_compile="true")
    assert plain["eval_accuracy"] >= 0.96 and abs(xla["eval_accuracy"] - plain["eval_accuracy"]) <= 0.01


def test_profile_steps_leave_a_trace_and_summaries_follow_their_interval(tmp_path):
    run(tmp_path, max_steps=30, steps_per_execution=5, profile_steps="5,10", summary_every_steps=10)
    traces = tf.io.gfile.glob(str(tmp_path / "run" / "tensorboard" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert traces and all(os.path.getsize(t) > 0 for t in traces)
    steps = set()
    for event_file in tf.io.gfile.glob(str(tmp_path / "run" / "tensorboard" / "events.*")):
        for event in tf.compat.v1.train.summary_iterator(event_file):
            if any(v.tag == "train/loss" for v in event.summary.value):
                steps.add(event.step)
    assert steps == {10, 20, 30}


def test_resume_compares_resolved_values_not_flags(tmp_path):
    common = dict(strategy="mirrored", num_cpu_replicas=2, all_reduce="reduce_to_one", max_steps=4)
    run(tmp_path, **common)
    # --lr_scaling=linear doubles the learning rate on 2 replicas: refused, naming the resolved value.
    with pytest.raises(UserError, match=r"learning_rate \(was 0\.003, now 0\.006\).*Restore the old setting"):
        run(tmp_path, lr_scaling="linear", **common)
    # On one replica the same flag resolves to the same rate: a different topology, the same plan.
    again = run(tmp_path, lr_scaling="linear", strategy="default", max_steps=8)
    assert (again["resumed_from_step"], again["steps"]) == (4, 8)


# tfds:NAME: the train split streamed from the prepared files (tests/tiny_digits.py: 2,000 train and
# 500 test digits from the bundled ones, 4 files), through fit's dataset-function path.
def tfds_run(tmp_path, data_dir, name="run", **changes):
    return run(tmp_path, name, dataset="tfds:tiny_digits", data_dir=data_dir, **changes)


def test_tfds_train_split_streams_from_files_and_learns(tmp_path, tiny_digits_dir, monkeypatch):
    read = []
    real = data._to_arrays
    monkeypatch.setattr(data, "_to_arrays", lambda dataset: read.append(real(dataset)) or read[-1])
    metrics = tfds_run(tmp_path, tiny_digits_dir, epochs=3, global_batch_size=64)
    assert [len(labels) for _, labels in read] == [500]  # The test split only; the train split is never read whole.
    assert (metrics["train_input"], metrics["steps_per_epoch"], metrics["steps"]) == ("streamed", 31, 3 * 31)
    # Measured 0.936-0.942 over seeds 0-3 (arrays of the same digits: 0.922-0.942).
    assert_evaluated(metrics, 500)
    assert metrics["eval_accuracy"] >= 0.90
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert (plan["dataset"], plan["data"], plan["steps_per_epoch"]) == ("tfds:tiny_digits", "dataset_fn", 31)


def test_tfds_stream_trains_the_same_on_one_or_two_local_replicas(tmp_path, tiny_digits_dir):
    """One input pipeline per process: its replicas split each global batch in order (20 steps: past a pass).

    Each run is a fresh tfdist-train process, as users run it. (In-process, after some other tests of the
    same xdist worker, the two runs differed by 4.5e-4, deterministically; alone they agree to 7e-5.
    The state that carries over was not found: see the closing note of issue 19.)
    """
    common = ["--precision=float32", "--optimizer=sgd", "--learning_rate=0.1", "--max_steps=20",
              "--dataset=tfds:tiny_digits", f"--data_dir={tiny_digits_dir}"]
    for name, strategy in (("one", ["--strategy=default"]),
                           ("two", ["--strategy=mirrored", "--num_cpu_replicas=2", "--all_reduce=reduce_to_one"])):
        result = subprocess.run([sys.executable, "-m", "tfdist.cli.train", *common, *strategy,
                                 f"--workdir={tmp_path / name}"], capture_output=True, text=True, timeout=300,
                                cwd=REPO, env=subprocess_env())
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for a, b in zip(load_weights(str(tmp_path / "one" / "model.keras")),
                    load_weights(str(tmp_path / "two" / "model.keras"))):
        # Summation-order noise after 20 steps at this learning rate: measured 4e-5 to 7e-5.
        np.testing.assert_allclose(a, b, atol=2e-4)


def test_tfds_stream_resumes_on_the_same_trajectory(tmp_path, tiny_digits_dir):
    common = dict(precision="float32", optimizer="sgd", learning_rate=0.1, epochs=2)  # 2 x 15 steps.
    tfds_run(tmp_path, tiny_digits_dir, "whole", **common)
    tfds_run(tmp_path, tiny_digits_dir, "resumed", max_steps=20, **common)  # Past the first pass.
    metrics = tfds_run(tmp_path, tiny_digits_dir, "resumed", **common)
    assert (metrics["resumed_from_step"], metrics["steps"]) == (20, 30)
    for a, b in zip(load_weights(str(tmp_path / "whole" / "model.keras")),
                    load_weights(str(tmp_path / "resumed" / "model.keras"))):
        np.testing.assert_allclose(a, b, atol=1e-5)
    with pytest.raises(UserError, match=r"dataset \(was 'tfds:tiny_digits', now 'mnist'\)"):
        run(tmp_path, "resumed", **common)


def test_checkpoint_every_secs_becomes_a_step_interval_measured_at_the_start(tmp_path):
    run(tmp_path, max_steps=40, steps_per_execution=2, checkpoint_every_secs=0.3, keep_checkpoints=100,
        precision="float32")
    saved = sorted(int(p[len("ckpt-"):-len(".index")]) for p in os.listdir(tmp_path / "run" / "checkpoints")
                   if p.endswith(".index"))
    # Measured after two short segments (steps 0-4 and 4-8); from then on every N steps, and at the end.
    intervals = [n for n in range(1, 40) if saved == sorted({s for s in range(n, 40, n) if s >= 8} | {40})]
    assert intervals, saved  # Saves at the multiples of one interval, and at least one before the end.


def test_checkpoint_every_secs_below_zero_is_refused():
    with pytest.raises(UserError, match=r"--checkpoint_every_secs=-1.0 must be 0 \(off\) or a positive number"):
        TrainConfig(checkpoint_every_secs=-1.0).validate()


def test_zero_stage_trains_as_unsharded_and_reports_each_replicas_state(tmp_path):
    """tfdist-train --zero_stage=2 (Adam, 2 replicas): the weights of the unsharded run, exported whole in
    model.keras; metrics.json holds each replica's part of Adam's state, which together make the whole."""
    common = dict(precision="float32", max_steps=6, strategy="mirrored", num_cpu_replicas=2,
                  all_reduce="reduce_to_one")
    whole = run(tmp_path, "whole", **common)
    sharded = run(tmp_path, "sharded", zero_stage=2, **common)
    for a, b in zip(load_weights(str(tmp_path / "whole" / "model.keras")),
                    load_weights(str(tmp_path / "sharded" / "model.keras"))):
        np.testing.assert_allclose(a, b, atol=1e-6)
    weights = load_weights(str(tmp_path / "sharded" / "model.keras"))
    params = sum(int(np.prod(w.shape)) for w in weights)
    assert "zero_stage" not in whole and sharded["zero_stage"] == 2
    parts = sharded["optimizer_state_bytes_per_replica"]
    # Equal flat shards: the same bytes on each replica, padded by under 2 floats a moment a bucket.
    assert len(parts) == 2 and parts[0] == parts[1] and sum(parts) == sharded["optimizer_state_bytes_total"]
    assert 8 * params <= sum(parts) < 8 * (params + 2 * len(weights))


def test_a_non_finite_loss_stops_tfdist_train_unless_told_to_go_on(tmp_path):
    """tfdist-train keeps the non-finite guard on (--stop_on_nonfinite); --nostop_on_nonfinite trains on, as
    tfdist.fit and Keras' fit do."""
    diverging = {"optimizer": "sgd", "learning_rate": 1e12, "max_steps": 4, "precision": "float32"}
    with pytest.raises(UserError, match=r"The training loss became non-finite \(NaN or inf\)"):
        run(tmp_path, "stops", **diverging)
    metrics = run(tmp_path, "goes_on", stop_on_nonfinite=False, **diverging)
    assert metrics["steps"] == 4

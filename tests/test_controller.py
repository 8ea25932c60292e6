"""tfdist.training.controller: what the outer loop guarantees across real worker processes.

Workers that disagree fail fast with a message naming them; SIGTERM to one
worker stops every worker at the same step; a worker whose execution fails
exits, so the job ends, although its next execution was already dispatched; a
float16 overflow on one worker is skipped by all of them.
"""

import contextlib
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, subprocess_env
from tests.test_launch import Job

TRAIN = [sys.executable, "-m", "tfdist.cli.train"]


def launch(command, timeout=300):
    return subprocess.run([sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2", "--", *command],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=subprocess_env())


def per_worker(flag_for_worker_1):
    """A shell command giving worker 1 one extra flag (as a machine with other settings would)."""
    train = " ".join(TRAIN + ["--strategy=multi_worker_mirrored", "--max_steps=20", "--epochs=1"])
    index = "$(python3 -c 'import json,os; print(json.loads(os.environ[\"TF_CONFIG\"])[\"task\"][\"index\"])')"
    return ["sh", "-c", f'if [ {index} = 1 ]; then exec {train} "$@" {flag_for_worker_1}; '
                        f'else exec {train} "$@"; fi', "sh"]


def test_workers_with_different_plans_fail_fast_naming_them(tmp_path):
    start = time.time()
    result = launch([*per_worker("--global_batch_size=64"), f"--workdir={tmp_path / 'w'}"])
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert time.time() - start < 120
    assert re.search(r"The workers disagree about the plan \(batch sizes, steps, seed, learning rate, dataset\): "
                     r"tasks worker 0, worker 1 resolved different values", output), output[-3000:]
    assert "global_batch (worker 0: 128, worker 1: 64)" in output, output[-3000:]  # Each field, each task's value.
    assert "Traceback" not in output


def test_workers_that_restored_different_steps_fail_fast(tmp_path):
    # Worker 1 is pointed at a workdir of its own that holds a checkpoint: an unshared workdir.
    own = tmp_path / "own"
    first = subprocess.run([*TRAIN, "--strategy=default", "--max_steps=10", "--epochs=1", "--global_batch_size=128",
                            f"--workdir={own}"], capture_output=True, text=True, cwd=REPO, env=subprocess_env(),
                           timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    result = launch([*per_worker(f"--workdir={own}"), f"--workdir={tmp_path / 'w'}"])
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "The workers restored different checkpoints (worker 0 step 0, worker 1 step 10): is --workdir on " \
           "storage every machine shares?" in output, output[-3000:]


def test_sigterm_to_one_worker_stops_both_at_the_same_step(tmp_path):
    job = Job(tmp_path, ["--strategy=multi_worker_mirrored", f"--workdir={tmp_path / 'w'}",
                         "--checkpoint_every_steps=20", "--epochs=3"])
    job.wait_for(r"Saved checkpoint \S+ckpt-\d+ at step")
    job.pids()  # Both started.
    import os

    os.kill(job.pids()["worker:1"], signal.SIGTERM)
    assert job.wait(timeout=180) == 143, job.output[-4000:]
    steps = re.findall(r"^\[(worker:\d)\] .*stopped by a signal at step (\d+)", job.output, re.M)
    assert {w for w, _ in steps} == {"worker:0", "worker:1"} and len({s for _, s in steps}) == 1, job.output[-4000:]


def test_a_worker_whose_input_fails_ends_the_job():
    result = launch([sys.executable, "tests/programs/worker_fails.py"], timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "corrupt record in shard 1" in output, output[-3000:]
    # Worker 1 told worker 0 of its error (tfdist.distribute.barriers): both may end before the launcher stops any.
    assert "tfdist-launch: worker:1 exited with status 1: InvalidArgumentError: Graph execution error:" in output, \
        output[-3000:]
    assert "trained" not in result.stdout


def test_float16_overflow_on_one_worker_is_skipped_by_both():
    result = launch([sys.executable, "tests/programs/fp16_overflow.py", "multi_worker_mirrored"], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = re.findall(r"^\[worker:\d\] (scale .*)$", result.stdout, re.M)
    assert len(lines) == 2 and lines[0] == lines[1], result.stdout[-3000:]
    assert lines[0].startswith("scale 32768 -> 16384 unchanged=True finite=True"), lines


def test_float16_overflow_on_one_of_two_cpu_replicas():
    result = subprocess.run([sys.executable, "tests/programs/fp16_overflow.py", "mirrored"], capture_output=True,
                            text=True, timeout=240, cwd=REPO, env=subprocess_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "scale 32768 -> 16384 unchanged=True finite=True" in result.stdout, result.stdout


# Keras' fit contract for callbacks, in this process, against Keras' own fit on one device ----------------
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402

_RNG = np.random.default_rng(0)
CX = _RNG.normal(size=(256, 8)).astype("float32")
CY = (CX @ _RNG.normal(size=(8, 1))).astype("float32")


def small_model(strategy=None, optimizer=None):
    """`optimizer`: a function making it (optimizers made outside the scope hold variables of no strategy)."""
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="tanh",
                                                                        kernel_initializer=keras.initializers.GlorotUniform(0)),
                                  keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(1))])
        model.compile(optimizer=optimizer() if optimizer else keras.optimizers.SGD(0.05), loss="mse")
    return model


def batches(x=CX, y=CY):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(32, drop_remainder=True)


def default_strategy():
    return tfdist.make_strategy("default", precision="float32")


def assert_same_weights(a, b, atol=1e-5):
    for u, v in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(u, v, atol=atol)


def test_a_second_fit_after_early_stopping_trains_as_keras_does():
    # Keras resets model.stop_training at the start of every fit; EarlyStopping then stops each fit after 2 epochs.
    def stopper():
        return keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=0)

    reference, model = small_model(), small_model(default_strategy())
    for _ in range(2):
        expected = reference.fit(batches(), epochs=5, callbacks=[stopper()], verbose=0, shuffle=False)
        got = tfdist.fit(model, batches(), epochs=5, callbacks=[stopper()], verbose=0, steps_per_execution=1)
        assert got.epoch == expected.epoch == [0, 1]
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 32
    assert_same_weights(model, reference)


def test_terminate_on_nan_stops_after_the_batch_as_in_keras(tmp_path):
    x = CX.copy()
    x[3 * 32 + 5, 0] = np.nan  # Batch 3 has a NaN input: its loss is NaN.
    reference, model = small_model(), small_model(default_strategy())
    expected = reference.fit(batches(x), epochs=2, callbacks=[keras.callbacks.TerminateOnNaN()], verbose=0,
                             shuffle=False)
    got = tfdist.fit(model, batches(x), epochs=2, callbacks=[keras.callbacks.TerminateOnNaN()], verbose=0,
                     steps_per_execution=1, workdir=str(tmp_path / "w"))
    # The NaN weights are neither checkpointed nor exported: a rerun would resume from them.
    assert not list((tmp_path / "w").glob("checkpoints/ckpt-*")) and not (tmp_path / "w" / "model.keras").exists()
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 4
    assert got.epoch == expected.epoch == [0] and np.isnan(got.history["loss"][0])
    with pytest.raises(tfdist.UserError, match="The training loss became non-finite"):  # The opt-in guard.
        tfdist.fit(small_model(default_strategy()), batches(x), epochs=1, verbose=0, steps_per_execution=1,
                   stop_on_nonfinite=True)


def test_per_batch_hooks_see_each_execution_with_the_running_logs():
    seen = []
    hook = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: seen.append(("begin", b)),
                                          on_train_batch_end=lambda b, logs: seen.append(("end", b, logs["loss"])))
    model = small_model(default_strategy())
    history = tfdist.fit(model, batches(), epochs=1, callbacks=[hook], verbose=0, steps_per_execution=3)
    # Keras' end index is the execution's first batch + steps_per_execution - 1, the short last one's too.
    assert [s[:2] for s in seen] == [("begin", 0), ("end", 2), ("begin", 3), ("end", 5), ("begin", 6), ("end", 8)]
    assert seen[-1][2] == pytest.approx(history.history["loss"][0], rel=1e-6)  # The epoch's running mean.


@pytest.mark.parametrize("name,options", [("default", {}), ("mirrored", {"num_cpu_replicas": 2,
                                                                         "all_reduce": "reduce_to_one"})])
def test_optimizer_ema_weights_are_finalized_as_in_keras(name, options):
    def ema():
        return keras.optimizers.SGD(0.05, use_ema=True, ema_momentum=0.9)

    reference = small_model(optimizer=ema)
    reference.fit(batches(), epochs=2, verbose=0, shuffle=False)
    model = small_model(tfdist.make_strategy(name, precision="float32", **options), optimizer=ema)
    tfdist.fit(model, batches(), epochs=2, verbose=0)
    raw = small_model()
    raw.fit(batches(), epochs=2, verbose=0, shuffle=False)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(raw.get_weights(), reference.get_weights())) > 1e-3
    assert_same_weights(model, reference)


class Interrupt(keras.callbacks.Callback):
    """Keras' BackupAndRestore example: training dies at the start of an epoch."""

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_at_its_epoch_as_in_keras(tmp_path):
    results = []
    for run, fit in (("keras", lambda m, cbs: m.fit(batches(), epochs=4, callbacks=cbs, verbose=0, shuffle=False)),
                     ("tfdist", lambda m, cbs: tfdist.fit(m, batches(), epochs=4, callbacks=cbs, verbose=0))):
        model = small_model(default_strategy() if run == "tfdist" else None)
        backup = str(tmp_path / run)
        with pytest.raises(RuntimeError, match="interrupted"):
            fit(model, [keras.callbacks.BackupAndRestore(backup), Interrupt()])
        history = fit(model, [keras.callbacks.BackupAndRestore(backup)])
        results.append((model, history.epoch, int(model.optimizer.iterations.numpy())))
    (reference, expected_epochs, expected_steps), (model, epochs, steps) = results
    assert epochs == expected_epochs == [2, 3] and steps == expected_steps
    assert_same_weights(model, reference)


def test_only_the_chief_runs_file_writing_callbacks(tmp_path):
    result = launch([sys.executable, "tests/programs/callbacks_per_task.py", str(tmp_path)], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    written = sorted(p.name for p in tmp_path.iterdir())
    # Each task names its files after itself: only the chief's exist, and every worker restored the backup.
    assert written == ["backup", "task0.csv", "task0.keras", "tb0"], written
    assert re.findall(r"^\[worker:\d\] (restored .*)$", result.stdout, re.M) == ["restored epoch 1"] * 2, \
        result.stdout[-3000:]


def test_a_task_that_does_not_run_the_chiefs_callbacks_keeps_as_many_executions_in_flight(tmp_path, monkeypatch):
    # TensorBoard writing per batch (per-batch hooks) runs on the chief only. A worker that kept one execution more in flight
    # would wait, after a stop or an error, for an execution the chief never dispatches.
    import types

    from tfdist.training import controller, fitting

    as_worker = fitting.callbacks_for_task
    monkeypatch.setattr(fitting, "callbacks_for_task",
                        lambda callbacks, backend: as_worker(callbacks, types.SimpleNamespace(is_chief=False)))
    seen = []
    run = controller.Controller.run
    monkeypatch.setattr(controller.Controller, "run", lambda self, step: (seen.append(self.in_flight), run(self, step))[1])
    tfdist.fit(small_model(default_strategy()), batches(), epochs=1, verbose=0,
               callbacks=[keras.callbacks.TensorBoard(str(tmp_path / "tb"), update_freq="batch")])
    assert seen == [1] and not (tmp_path / "tb").exists()  # As on the chief, which runs TensorBoard's hooks.


def test_both_workers_stop_with_the_non_finite_error_while_the_chief_alone_runs_tensorboard(tmp_path):
    result = launch([sys.executable, "tests/programs/callbacks_disagree.py", "nan", str(tmp_path)], timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    raised = re.findall(r"^\[(worker:\d)\] tfdist\.errors\.UserError: The training loss became non-finite", output,
                        re.M)
    assert sorted(set(raised)) == ["worker:0", "worker:1"], output[-3000:]  # Each raised it itself.


def test_workers_that_restored_different_backups_fail_fast(tmp_path):
    result = launch([sys.executable, "tests/programs/callbacks_disagree.py", "backup", str(tmp_path)], timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "The workers restored different checkpoints (worker 0 step 8, worker 1 step 0)" in output, output[-3000:]
    assert "a BackupAndRestore at a backup_dir they all share" in output

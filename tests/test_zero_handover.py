"""tfdist.training.zero.handover: a user's optimizer built before a sharded fit (an earlier Keras fit, a loaded
model.keras) hands its state over to the shards, holds no slot buffer while the fit runs, and gets the trained
state back after it, as Keras' fit leaves it (tests/test_zero.py's
`test_an_optimizer_keras_already_built_hands_its_state_over`: the values against Keras' 20 steps)."""

import functools
import gc
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.training.fitting import train
from tfdist.training import zero
from tfdist.training.zero import handover
from tests.test_horovod import horovodrun, needs_horovod
from tests.zero_model import BATCH, data, model

MIRRORED = {"all_reduce": "reduce_to_one"}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def close(a, b, atol):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, atol=atol, rtol=0)


def allocated() -> int:
    return tf.config.experimental.get_memory_info("CPU:0")["current"]


def adam_state(optimizer):
    own = {id(optimizer.iterations), id(optimizer._learning_rate)}
    return [v for v in optimizer.variables if id(v) not in own]


def test_the_slots_of_a_built_optimizer_are_freed_during_a_sharded_fit_and_given_back_after():
    """2 replicas, Adam built by a first fit (76 MB of moments over the replicas' copies): once tfdist.fit at
    stage 1 has begun, TensorFlow's allocator holds about half the user's state less than before it (the whole
    moments freed, the half each replica owns in the shards), not the shards on top of the whole state; after
    it, the state is the user's again and the shards' copy is emptied. (MirroredStrategy's collective ops: its
    reduce_to_one all-reduce keeps buffers allocated after the steps.) In a fresh process: a collective
    strategy counts TensorFlow's instance keys from 100 again, and a key an earlier strategy of the process
    (another test's, under pytest-xdist) used for another shape aborts the unsharded fit's all-reduce."""
    from tests.conftest import subprocess_env
    code = ("import tests.conftest; from tests.test_zero_handover import slots_freed_and_given_back; "
            "slots_freed_and_given_back()")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO,
                            env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


def slots_freed_and_given_back() -> None:
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32")
    with strategy.scope():
        keras.utils.set_random_seed(1)
        net = keras.Sequential([keras.Input((512,))] + [keras.layers.Dense(1024) for _ in range(5)]
                               + [keras.layers.Dense(3)])
        net.compile(optimizer=keras.optimizers.Adam(0.001), loss="mse")
    x = np.random.default_rng(0).normal(size=(4 * BATCH, 512)).astype("float32")
    y = np.zeros((4 * BATCH, 3), "float32")
    # An unsharded fit builds the optimizer, each replica's moments written by its own update. (Keras' own fit
    # on collective replicas would meet instance keys the other tests' strategies used in this process.)
    tfdist.fit(net, x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0, strategy=strategy)
    whole = sum(int(np.prod(v.shape)) * 4 for v in adam_state(net.optimizer)) * 2  # On each replica.
    begun, seen = [], []  # At the fit's start (the shards made, the slots freed, no step yet), after each step.
    measure = keras.callbacks.LambdaCallback(on_train_begin=lambda logs: begun.append(allocated()),
                                             on_train_batch_end=lambda batch, logs: seen.append(allocated()))
    gc.collect()
    before = allocated()
    tfdist.fit(net, x, y, batch_size=BATCH, shuffle=False, verbose=0, zero_stage=1, strategy=strategy,
               callbacks=[measure])
    print(f"allocated (MB): before {before / 1e6:.1f}, fit begun {begun[0] / 1e6:.1f}, after each step "
          f"{[round(b / 1e6, 1) for b in seen]}; the user's moments {whole / 1e6:.1f}")
    # Freed: before - whole / 2, and a few MB the allocator's other users hold at that moment (up to 9 MB over
    # 4 runs here). Without the freeing: the shards beside the whole state (before + whole / 2 and more); one
    # replica's copy freed, the other's not: before.
    assert begun[0] < before - whole / 8, (before, begun, whole)
    assert len(seen) == 4 and max(seen) < before + whole / 8, (before, seen, whole)  # The steps' own buffers.
    assert all(tuple(v.shape) == tuple(np.asarray(v).shape) for v in net.optimizer.variables)
    shards = zero._SHARDED[net.optimizer].shards.values()  # Their copy released: the user's optimizer holds it.
    assert {np.asarray(v.read_value()).size for shard in shards for key, v in shard.slots().items()
            if key.startswith("b")} == {0}


def built_under(strategy):
    """The model built under `strategy`, its Adam built by Keras' fit for 10 steps."""
    x, y = data()
    with strategy.scope():
        net = model(lambda: keras.optimizers.Adam(0.01))
    net.fit(x[:10 * BATCH], y[:10 * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    return net


def test_a_checkpoint_saved_during_the_fit_holds_the_users_optimizer_whole_and_resumes(tmp_path):
    """Keras' fit for 10 steps, then a sharded tfdist.fit with checkpoints every 5 steps that stops at 5: the
    checkpoint's user optimizer holds Keras' 15-step state at its shapes (not the freed slots, nor the state
    before the fit), and so does the model.keras a Keras ModelCheckpoint saved at step 5; a second model
    resumes the checkpoint to Keras' 20 steps, its own optimizer built as well."""
    x, y = data()
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)

    built = functools.partial(built_under, strategy)

    def keras_run(steps):
        reference = model(lambda: keras.optimizers.Adam(0.01))
        reference.fit(x[:steps * BATCH], y[:steps * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
        return reference

    run = str(tmp_path / "run")
    options = dict(batch_size=BATCH, shuffle=False, verbose=0, zero_stage=2, strategy=strategy, workdir=run,
                   checkpoint_every_steps=5, export=())
    saver = keras.callbacks.ModelCheckpoint(str(tmp_path / "model.keras"), save_freq=5)
    train(built(), x[10 * BATCH:], y[10 * BATCH:], max_steps=5, callbacks=[saver], **options)
    saved = tf.train.load_checkpoint(os.path.join(run, "checkpoints", "ckpt-5"))
    shapes = saved.get_variable_to_shape_map()
    state = adam_state(keras_run(15).optimizer)
    keys = sorted((k for k in shapes if k.startswith("optimizer/_variables/")), key=lambda k: int(k.split("/")[2]))
    held = [saved.get_tensor(k) for k in keys if int(k.split("/")[2]) >= 2]  # After the step count and rate.
    close(held, [np.asarray(v) for v in state], 1e-5)
    loaded = keras.saving.load_model(str(tmp_path / "model.keras"))  # Keras' ModelCheckpoint, at the same step.
    close([np.asarray(v) for v in adam_state(loaded.optimizer)], [np.asarray(v) for v in state], 1e-5)
    net = built()
    train(net, x[10 * BATCH:], y[10 * BATCH:], max_steps=10, **options)
    reference = keras_run(20)
    close(net.get_weights(), reference.get_weights(), 1e-5)
    close([np.asarray(v) for v in net.optimizer.variables], [np.asarray(v) for v in reference.optimizer.variables],
          1e-5)


@pytest.mark.jobs
def test_two_workers_give_the_trained_state_back_by_a_collective_gather(tmp_path):
    """2 MultiWorkerMirrored workers, the user's Adam built with Keras' 10-step state, 10 steps at stage 2: each
    worker's optimizer holds Keras' 20-step state after the fit (its half all-gathered from the other's)."""
    from tests.conftest import subprocess_env

    result = subprocess.run([sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2", "--", sys.executable,
                             "tests/programs/zero_handover_job.py", str(tmp_path), "2"], capture_output=True,
                            text=True, timeout=300, cwd=REPO, env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    hold_keras_state(tmp_path)


@pytest.mark.jobs
def test_two_workers_carry_a_stage_1_fits_state_over_to_a_stage_3_fit(tmp_path):
    """2 MultiWorkerMirrored workers, Adam not built before: 10 steps at stage 1 (the state in its shards alone,
    a layout stage 3 does not use), then 10 at stage 3: the state is gathered to each worker's optimizer in
    between, and each ends with Keras' 20-step state and weights."""
    from tests.conftest import subprocess_env

    result = subprocess.run([sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2", "--", sys.executable,
                             "tests/programs/zero_handover_job.py", str(tmp_path), "1,3"], capture_output=True,
                            text=True, timeout=300, cwd=REPO, env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reference = hold_keras_state(tmp_path)
    for task in range(2):
        saved = np.load(tmp_path / f"weights{task}.npz")
        close([saved[f"arr_{k}"] for k in range(len(saved.files))], reference.get_weights(), 1e-5)


@needs_horovod
def test_two_horovod_ranks_give_the_trained_state_back_by_an_allgather(tmp_path):
    """As above under horovodrun, at stage 3 (hvd.allgather gives each rank the other's half of the state):
    Keras' 20-step state on both ranks."""
    result = horovodrun([sys.executable, os.path.join(REPO, "tests", "programs", "zero_handover_job.py"),
                         str(tmp_path), "3", "horovod"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    hold_keras_state(tmp_path)


def hold_keras_state(out) -> keras.Model:
    """Each task's saved optimizer variables (tests/programs/zero_handover_job.py) are Keras' after 20 steps."""
    x, y = data()
    reference = model(lambda: keras.optimizers.Adam(0.01))
    reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    for task in range(2):
        saved = np.load(out / f"task{task}.npz")
        close([saved[f"arr_{k}"] for k in range(len(saved.files))],
              [np.asarray(v) for v in reference.optimizer.variables], 1e-5)
    return reference


def test_a_task_that_holds_some_shards_gathers_them_back_and_one_that_stops_alone_gets_zeros(monkeypatch, caplog):
    """As a multi-worker task (some shards elsewhere): the trained state comes back by an all-gather inside a
    replica step; a task stopping on its own error (no peer to gather with) gets zeros at the slots' shapes and
    an error line, without waiting."""
    monkeypatch.setattr(handover, "_all_here", lambda sharded: False)
    x, y = data()
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)

    built = functools.partial(built_under, strategy)

    net = built()
    tfdist.fit(net, x[10 * BATCH:], y[10 * BATCH:], batch_size=BATCH, shuffle=False, verbose=0, zero_stage=1,
               strategy=strategy)
    reference = model(lambda: keras.optimizers.Adam(0.01))
    reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    close([np.asarray(v) for v in net.optimizer.variables], [np.asarray(v) for v in reference.optimizer.variables],
          1e-5)

    def fail(batch, logs):
        if batch == 2:
            raise RuntimeError("this task alone")
    net = built()
    with pytest.raises(RuntimeError, match="this task alone"):
        tfdist.fit(net, x[10 * BATCH:], y[10 * BATCH:], batch_size=BATCH, shuffle=False, verbose=0, zero_stage=1,
                   strategy=strategy, callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=fail)])
    for v in adam_state(net.optimizer):
        close([np.asarray(c) for c in getattr(v.value, "values", [v.value])],
              [np.zeros(v.shape, "float32")] * 2, 0)
    assert "is not gathered back" in caplog.text


def test_a_backup_and_restore_callback_restores_the_optimizer_state_the_shards_go_on_from(tmp_path):
    """Keras' BackupAndRestore restores the model and its optimizer in on_train_begin, inside the sharded fit:
    the shards go on from the restored state (Keras' fit for 10 steps, an epoch of 10 backed up, then a second
    model, built alike, resumes the backup for its second epoch: Keras' 30 steps)."""
    x, y = data()
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)

    built = functools.partial(built_under, strategy)

    def backed_up(epochs):
        net = built()
        tfdist.fit(net, x[10 * BATCH:], y[10 * BATCH:], batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                   zero_stage=1, strategy=strategy,
                   callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path), delete_checkpoint=False)])
        return net
    backed_up(1)
    net = backed_up(2)
    reference = model(lambda: keras.optimizers.Adam(0.01))
    reference.fit(x[:10 * BATCH], y[:10 * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    reference.fit(x[10 * BATCH:], y[10 * BATCH:], batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    close(net.get_weights(), reference.get_weights(), 1e-5)
    close([np.asarray(v) for v in net.optimizer.variables], [np.asarray(v) for v in reference.optimizer.variables],
          1e-5)

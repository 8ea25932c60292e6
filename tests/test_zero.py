"""tfdist.training.zero: the optimizer state in equal flat shards over the replicas (`zero_stage`), exact
against Keras.

In-process MirroredStrategy replicas (reduce_to_one: the all-reduce fallback; its collective default on 2
replicas, and on 4 in a fresh process: the all-to-all reduce-scatter and the all-gather of equal parts), real
MultiWorkerMirrored processes and Horovod ranks (hvd.reducescatter, hvd.allgather). Float32, fixed batches, 20
steps: the same weights as the unsharded run (1e-6, or bit for bit) and as Keras' own fit (1e-5).
"""

import dataclasses
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import tfdist
from tfdist.distribute import strategies
from tfdist.distribute.backend import tf_variable
from tfdist.errors import UserError
from tfdist.training import zero
from tfdist.training.fitting import train
from tests.test_horovod import horovodrun, needs_horovod
from tests.zero_model import BATCH, EXAMPLES, data, keras_weights, model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIRRORED = {"all_reduce": "reduce_to_one"}
OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "global_clipnorm": lambda: keras.optimizers.SGD(0.2, global_clipnorm=0.3),
    "ema": lambda: keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9),
    "keras_accumulation": lambda: keras.optimizers.SGD(0.1, momentum=0.5, gradient_accumulation_steps=2),
    "nadam": lambda: keras.optimizers.Nadam(0.01),  # Its own update step (a running product) around Keras'.
    "loss_scale_factor": lambda: keras.optimizers.SGD(0.2, loss_scale_factor=64.0, global_clipnorm=0.3),
    "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0 ** 15,
                                                              dynamic_growth_steps=3),
}


def sharded_fit(replicas, optimizer, stage, collective=False, **kwargs):
    """Reduce-to-one replicas (the all-reduce fallback), or with `collective` MirroredStrategy's collective
    ops (all-to-all and all-gather; 2 replicas only in one process: `test_zero_collectives`)."""
    options = {**({} if collective else MIRRORED), **{k: kwargs.pop(k) for k in ("all_reduce_dtype",) if k in kwargs}}
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=replicas, precision="float32", **options) \
        if replicas > 1 else tfdist.make_strategy("default", precision="float32")
    with strategy.scope():
        net = model(optimizer)
    x, y = data()
    result = train(net, x, y, batch_size=BATCH, shuffle=False, verbose=0, strategy=strategy, zero_stage=stage,
                   export=(), **kwargs)
    return net, result


def close(a, b, atol):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, atol=atol, rtol=0)


# tfdist's unsharded step cannot run Keras' own gradient accumulation under MirroredStrategy (Keras' TensorFlow
# optimizer merges replicas inside a cond there); sharded, each clone runs it as Keras on one device does.
UNSHARDED_FAILS = {"keras_accumulation"}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_updates_equal_unsharded_and_keras_on_1_2_and_4_replicas(name):
    expected = keras_weights(OPTIMIZERS[name])
    unsharded = None if name in UNSHARDED_FAILS else sharded_fit(4, OPTIMIZERS[name], 0)[0]
    for replicas, stage in ((1, 1), (2, 2), (4, 1)):
        net, result = sharded_fit(replicas, OPTIMIZERS[name], stage)
        accumulated = OPTIMIZERS[name]().gradient_accumulation_steps or 1  # Keras counts updates then.
        assert result.steps == 20 and int(np.asarray(net.optimizer.iterations)) == 20 // accumulated
        assert not net.optimizer.built  # No replica ever held the whole state.
        close(net.get_weights(), expected, 1e-5)
        if replicas == 4 and unsharded is not None:
            close(net.get_weights(), unsharded.get_weights(), 1e-6)


@pytest.mark.keras_internals  # The optimizer clone binds Keras' backend-agnostic methods (tfdist.training.zero).
def test_stage_2_reduces_each_micro_batch_and_keeps_the_global_norm():
    expected = keras_weights(OPTIMIZERS["global_clipnorm"])
    net, _ = sharded_fit(4, OPTIMIZERS["global_clipnorm"], 2, grad_accum_steps=3)
    close(net.get_weights(), expected, 1e-5)


@pytest.mark.keras_internals
def test_a_loss_scale_skips_a_non_finite_step_on_every_replica_and_shrinks_as_keras():
    """An overflowing scaled gradient on the first steps: Keras skips them and halves the scale; the sharded
    state decides it from the whole gradient, so every owner skips together."""
    def huge():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0 ** 127)
    expected = keras_weights(huge)
    net, result = sharded_fit(4, huge, 1)
    close(net.get_weights(), expected, 1e-5)
    assert result.steps == 20


def test_each_replica_holds_an_equal_share_of_the_adam_state_and_metrics_report_it():
    net, result = sharded_fit(4, OPTIMIZERS["adam"], 1)
    state = result.optimizer_state
    per_replica, total = state["optimizer_state_bytes_per_replica"], state["optimizer_state_bytes_total"]
    whole = sum(2 * 4 * int(np.prod(v.shape)) for v in net.trainable_variables)  # Adam: two moments.
    assert (state["zero_stage"], len(per_replica)) == (1, 4)
    # Equal flat shards: 1/4 of the elements each, padded to a multiple of 4 (under 4 floats a moment).
    assert len(set(per_replica)) == 1 and whole <= total < whole + 2 * 4 * 4
    # Between steps a replica keeps no copy of its weight slice (emptied after each step's all-gather).
    shards = zero._SHARDED[net.optimizer].shards.values()
    assert [np.asarray(tf_variable(p)).size for shard in shards for p in shard.params] == [0] * 4


def test_a_variable_cut_between_replicas_keeps_its_per_variable_rules():
    """AdamW excluding the kernels from weight decay by name (the 192-float one is cut in two on 2 replicas,
    in three on 4; the biases decay), SGD with clipnorm (each variable's own norm) and Lamb (each variable's
    trust ratio): rules over a whole variable, computed from the replicas' partial sums."""
    def excluding():
        optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.2)
        optimizer.exclude_from_weight_decay(var_names=["kernel"])
        return optimizer
    for make in (excluding, lambda: keras.optimizers.SGD(0.2, clipnorm=0.05),
                 lambda: keras.optimizers.Lamb(0.01)):
        expected = keras_weights(make)
        for replicas, stage in ((2, 1), (4, 2)):
            net, _ = sharded_fit(replicas, make, stage)
            close(net.get_weights(), expected, 1e-5)


def test_a_short_last_batch_with_replicas_that_hold_no_example_trains_as_keras():
    """230 examples, batch 12: the last batch holds 2, so on 4 replicas two parts hold none. At stage 2 each
    bucket's gradient is reduce-scattered as the backward pass makes it (`zero.taps`): an empty part must add
    nothing there (its mean loss is 0/0), before its gradient joins the sum."""
    x, y = data()
    reference = model(OPTIMIZERS["adam"])
    reference.fit(x[:230], y[:230], batch_size=BATCH, shuffle=False, verbose=0)
    for replicas, stage in ((4, 2), (2, 2), (4, 1)):
        strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=replicas, precision="float32", **MIRRORED)
        with strategy.scope():
            net = model(OPTIMIZERS["adam"])
        result = train(net, x[:230], y[:230], batch_size=BATCH, shuffle=False, verbose=0, zero_stage=stage,
                       export=())
        assert result.steps == 20
        close(net.get_weights(), reference.get_weights(), 1e-5)


class _HalfUsed(keras.layers.Layer):
    """A layer with a weight its call never reads (no gradient: Keras' optimizer leaves it alone)."""
    def build(self, shape):
        self.used = self.add_weight(shape=(shape[-1],), initializer="ones")
        self.unused = self.add_weight(shape=(7,), initializer="ones")

    def call(self, x):
        return x * self.used


def test_a_variable_without_a_gradient_and_a_constraint_are_left_as_keras_leaves_them():
    """AdamW on a model with an unused weight (in a shard with used ones: Keras neither decays nor moves it)
    and a MaxNorm kernel constraint (a rule over the whole kernel, applied after the update)."""
    def build(optimizer):
        keras.utils.set_random_seed(1)
        net = keras.Sequential([keras.Input((8,)), _HalfUsed(),
                                keras.layers.Dense(16, activation="tanh",
                                                   kernel_constraint=keras.constraints.MaxNorm(0.5)),
                                keras.layers.Dense(3)])
        net.compile(optimizer=optimizer, loss="mse")
        return net
    x, y = data()
    for make, settings in ((lambda: keras.optimizers.AdamW(0.05, weight_decay=0.3), ((2, 1), (4, 2))),
                           (lambda: keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.3, use_ema=True),
                            ((2, 1),))):  # EMA averages the unused weight unchanged, as Keras does.
        reference = build(make())
        reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        for replicas, stage in settings:
            strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=replicas, precision="float32", **MIRRORED)
            with strategy.scope():
                net = build(make())
            train(net, x, y, batch_size=BATCH, shuffle=False, verbose=0, zero_stage=stage, export=())
            close(net.get_weights(), reference.get_weights(), 1e-5)
            np.testing.assert_array_equal(net.layers[0].unused.numpy(), np.ones(7))


def agree_bit_for_bit() -> None:
    runs = [sharded_fit(2, OPTIMIZERS["adam"], stage, collective=True)[0] for stage in (0, 1, 2)]
    for net in runs[1:]:
        close(net.get_weights(), runs[0].get_weights(), 0)
    close(runs[0].get_weights(), keras_weights(OPTIMIZERS["adam"]), 1e-5)


def test_on_two_collective_replicas_sharded_and_unsharded_agree_bit_for_bit():
    """2 replicas on MirroredStrategy's collective ops (the all-to-all reduce-scatter and the all-gather of equal
    parts): a + b in either order, so Adam's weights are the same bits. In a fresh process: an earlier collective
    strategy of the same process (another test's, under pytest-xdist) took TensorFlow's instance keys first."""
    from tests.conftest import subprocess_env
    code = "import tests.conftest; from tests.test_zero import agree_bit_for_bit; agree_bit_for_bit()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO,
                            env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_gradients_that_travel_in_bfloat16_are_reduced_as_unsharded_then_sliced():
    """--all_reduce_dtype=bfloat16 changes the gradients on their way: the backend's own reduction, of which
    a replica keeps its slice, so the sharded run equals the unsharded one with the same compression."""
    runs = [sharded_fit(2, OPTIMIZERS["adam"], stage, all_reduce_dtype="bfloat16")[0] for stage in (0, 2)]
    close(runs[1].get_weights(), runs[0].get_weights(), 1e-6)


def test_a_checkpoint_resumes_on_another_replica_count_as_the_unsharded_run(tmp_path):
    """10 steps on 2 replicas, saved; resumed on 4 replicas and on 1 to step 20: Keras' 20 steps."""
    expected = keras_weights()
    first, _ = sharded_fit(2, None, 2, max_steps=10, workdir=str(tmp_path / "run"), checkpoint_every_steps=5)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("zero-")) == ["zero-10", "zero-5"]
    assert sorted(os.listdir(checkpoints / "zero-10"))[0].startswith("replica-0-of-2")
    for replicas in (4, 1):
        run = tmp_path / f"run{replicas}"
        subprocess.run(["cp", "-r", str(tmp_path / "run"), str(run)], check=True)
        net, result = sharded_fit(replicas, None, 1, workdir=str(run))
        assert (result.resumed_from, result.steps) == (10, 20)
        close(net.get_weights(), expected, 1e-5)


def test_resuming_across_sharded_and_unsharded_or_another_model_is_refused(tmp_path):
    sharded_fit(2, None, 1, max_steps=5, workdir=str(tmp_path / "sharded"), checkpoint_every_steps=5)
    with pytest.raises(UserError, match=r"sharded_optimizer_state \(was True, now None\)"):
        sharded_fit(2, None, 0, workdir=str(tmp_path / "sharded"))
    sharded_fit(2, None, 0, max_steps=5, workdir=str(tmp_path / "whole"), checkpoint_every_steps=5)
    with pytest.raises(UserError, match=r"sharded_optimizer_state \(was None, now True\)"):
        sharded_fit(2, None, 1, workdir=str(tmp_path / "whole"))
    # The sharded state of a model of another shape (the plan does not see widths).
    state = tmp_path / "sharded" / "checkpoints" / "zero-5"
    strategy = tfdist.make_strategy("default", precision="float32")
    wide = keras.Sequential([keras.Input((8,)), keras.layers.Dense(17, activation="tanh"),
                             keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(3)])
    wide.compile(optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.05, global_clipnorm=1.0), loss="mse")
    wide.build((None, 8))
    backend = strategies.backend_of(strategy)
    state_of_wide = zero.ShardedOptimizer(wide, backend, 1)
    with pytest.raises(UserError, match=r"has shape \(8, 16\), this model's \(8, 17\); the checkpoint was written "
                                        r"for a model of another shape"):
        state_of_wide.restore(str(state.parent), 5)
    with pytest.raises(UserError, match=r"sharded optimizer state of step 7 .* is missing or incomplete"):
        state_of_wide.restore(str(state.parent), 7)


def refused(match, optimizer=None, **kwargs):
    with pytest.raises(UserError, match=match):
        sharded_fit(2, optimizer, **kwargs)


def test_bad_stages_and_what_cannot_be_sharded_are_refused_before_any_step():
    refused(r"zero_stage=5 must be 0 .*, 1 .*, 2 .* or 3", stage=5)
    refused(r"zero_stage=True must be 0", stage=True)
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)

    class Custom(keras.Sequential):
        def train_step(self, data):
            return super().train_step(data)
    with strategy.scope():
        custom = Custom([keras.Input((8,)), keras.layers.Dense(3)])
        custom.compile(optimizer="adam", loss="mse")
        accumulating = model(lambda: keras.optimizers.SGD(0.1, global_clipnorm=1.0, gradient_accumulation_steps=2))
    x, y = data()
    with pytest.raises(UserError, match=r"cannot shard the optimizer of Custom, whose custom train_step calls its "
                                        r"optimizer itself"):
        tfdist.fit(custom, x, y, batch_size=BATCH, verbose=0, zero_stage=1)
    with pytest.raises(UserError, match=r"global_clipnorm=\.\.\., gradient_accumulation_steps=\.\.\."):
        tfdist.fit(accumulating, x, y, batch_size=BATCH, verbose=0, zero_stage=2)
    assert not custom.optimizer.built and not accumulating.optimizer.built


def test_a_tpu_is_refused():
    """A Cloud TPU cannot run here: its backend's one difference that matters (device_kind) stands in."""
    from tfdist.training import checks

    backend = strategies.backend_of(tfdist.make_strategy("default", precision="float32"))
    with pytest.raises(UserError, match=r"zero_stage=1 is not supported on a TPU"):
        checks.check_zero(model(), dataclasses.replace(backend, device_kind="tpu"), 1)


def launch(args, timeout=300):
    from tests.conftest import subprocess_env

    result = subprocess.run([sys.executable, "-m", "tfdist.cli.launch", *args], capture_output=True, text=True,
                            timeout=timeout, cwd=REPO, env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def job_weights(out, tasks):
    loaded = [np.load(os.path.join(out, f"task{i}.npz")) for i in range(tasks)]
    weights = [[f[f"arr_{k}"] for k in range(6)] for f in loaded]
    for other in weights[1:]:
        close(other, weights[0], 0)  # Every task holds the same whole model.
    return weights[0], json.loads(str(loaded[0]["state"]))


@pytest.mark.jobs
def test_two_workers_shard_then_resume_on_three_and_on_one(tmp_path, monkeypatch):
    """2 MultiWorkerMirrored workers at stage 3 (each layer's weights and optimizer state in halves) with 2
    micro-batches, 10 steps saved; resumed on 3 workers at stage 1 (buckets of 100 bytes, not one a layer) and
    on 1 process at stage 3, to step 20: each equals Keras' 20 steps and holds half (a third) of the state.
    (Stage 2's shards of 2 replicas resuming on 4 and 1: `test_a_checkpoint_resumes_on_another_replica_count_as_
    the_unsharded_run`; a stage-3 job shrinking from 3 workers to 2: tests/test_zero_checkpoint.py.)"""
    monkeypatch.setenv("TFDIST_TEST_BUCKET_BYTES", "100")
    expected = keras_weights()
    run = str(tmp_path / "run")
    program = [sys.executable, "tests/programs/zero_job.py"]
    launch(["--num_workers=2", "--", *program, str(tmp_path), "multi_worker_mirrored", "3", "10", run])
    _, state = job_weights(tmp_path, 2)
    assert (state["zero_stage"], len(state["optimizer_state_bytes_per_replica"])) == (3, 2)
    subprocess.run(["cp", "-r", run, run + "1"], check=True)
    os.makedirs(tmp_path / "three")
    launch(["--num_workers=3", "--", *program, str(tmp_path / "three"), "multi_worker_mirrored", "1", "20", run])
    weights, state = job_weights(tmp_path / "three", 3)
    close(weights, expected, 1e-5)
    assert (state["zero_stage"], len(state["optimizer_state_bytes_per_replica"])) == (1, 3)
    os.makedirs(tmp_path / "one")
    from tests.conftest import subprocess_env
    result = subprocess.run([*program, str(tmp_path / "one"), "default", "3", "20", run + "1"], cwd=REPO,
                            capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert result.returncode == 0, result.stderr[-3000:]
    weights, state = job_weights(tmp_path / "one", 1)
    close(weights, expected, 1e-5)
    assert state["zero_stage"] == 3


def test_four_collective_replicas_in_a_fresh_process_train_as_keras(tmp_path):
    """4 replicas of one process on MirroredStrategy's collective ops (the all-to-all reduce-scatter and the
    all-gather of equal parts among 4), small buckets: Keras' 20 steps. A fresh process: one process's
    collective groups keep the size of the first strategy that used them (`test_zero_collectives`)."""
    from tests.conftest import subprocess_env

    expected = keras_weights()
    env = subprocess_env({"TFDIST_TEST_BUCKET_BYTES": "100", "TFDIST_TEST_ACCUM": "1"})
    result = subprocess.run([sys.executable, "tests/programs/zero_job.py", str(tmp_path), "mirrored:4", "2", "20"],
                            cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    weights, state = job_weights(tmp_path, 1)
    close(weights, expected, 1e-5)
    assert len(set(state["optimizer_state_bytes_per_replica"])) == 1
    assert len(state["optimizer_state_bytes_per_replica"]) == 4


@needs_horovod
def test_two_horovod_ranks_reduce_scatter_and_gather_and_train_as_keras(tmp_path, monkeypatch):
    """hvd.reducescatter and hvd.allgather, a bucket of at most 100 bytes at a time (several a step, and
    one reduce-scatter per bucket and micro-batch at stage 2)."""
    monkeypatch.setenv("TFDIST_TEST_BUCKET_BYTES", "100")
    expected = keras_weights(steps=20)
    result = horovodrun([sys.executable, os.path.join(REPO, "tests", "programs", "zero_job.py"), str(tmp_path),
                         "horovod", "2", "20"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    weights, state = job_weights(tmp_path, 2)
    close(weights, expected, 1e-5)
    assert len(state["optimizer_state_bytes_per_replica"]) == 2


@pytest.mark.parametrize("replicas,stage", [(1, 1), (2, 2), (2, 3)])
def test_an_optimizer_keras_already_built_hands_its_state_over(replicas, stage):
    """Keras' 10 steps (Adam's moments built), then two sharded tfdist.fit calls of 5: Keras' 20 steps,
    and the user's optimizer left holding what Keras' fit leaves, iterations included (each fit gives the
    trained state back; the second goes on from what the first gave back). tests/test_zero_handover.py: its
    slots freed meanwhile."""
    x, y = data()
    reference = model(OPTIMIZERS["adam"])
    reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32",
                                    **(MIRRORED if stage < 3 else {})) \
        if replicas > 1 else tfdist.make_strategy("default", precision="float32")  # Stage 3: collective ops.
    with strategy.scope():
        net = model(OPTIMIZERS["adam"])
    if replicas == 1:
        net.fit(x[:10 * BATCH], y[:10 * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    else:  # As a loaded model.keras holds it (Keras' own fit on collective replicas would meet instance keys
        # the other tests' strategies used in this process).
        first = model(OPTIMIZERS["adam"])
        first.fit(x[:10 * BATCH], y[:10 * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
        with strategy.scope():
            net.optimizer.build(net.trainable_variables)
        net.set_weights(first.get_weights())
        for variable, value in zip(net.optimizer.variables, first.optimizer.variables):
            variable.assign(np.asarray(value))
    for part in (slice(10 * BATCH, 15 * BATCH), slice(15 * BATCH, 20 * BATCH)):
        tfdist.fit(net, x[part], y[part], batch_size=BATCH, shuffle=False, verbose=0, zero_stage=stage,
                   strategy=strategy)
    close(net.get_weights(), reference.get_weights(), 1e-5)
    assert int(np.asarray(net.optimizer.iterations)) == 20
    close([np.asarray(v) for v in net.optimizer.variables], [np.asarray(v) for v in reference.optimizer.variables],
          1e-5)  # In the same order (iterations, learning rate, the moments).


def test_a_second_fit_goes_on_from_the_first_fits_sharded_state():
    """Two tfdist.fit calls of 10 steps (Adam's moments carried over, as Keras' second fit carries them)."""
    expected = keras_weights(OPTIMIZERS["adam"])
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        net = model(OPTIMIZERS["adam"])
    x, y = data()
    for part in (slice(0, 10 * BATCH), slice(10 * BATCH, 20 * BATCH)):
        tfdist.fit(net, x[part], y[part], batch_size=BATCH, shuffle=False, verbose=0, zero_stage=1)
    close(net.get_weights(), expected, 1e-5)


def test_an_embedding_with_an_optimizer_that_moves_only_touched_rows_is_refused_and_sgd_trains():
    """Keras' Adam and RMSprop move an Embedding's state on the rows a batch touches only; the flat shards
    carry the gradient dense, so stage 1 ended 0.029 (Adam), 0.066 (RMSprop) and 0.056 (Adam with clipnorm)
    from Keras after 20 steps, and a clip that triggers counts a repeated id's rows apart in Keras (SGD with
    global_clipnorm=0.01: 8e-5 off): refused before any step. SGD with momentum updates from the dense form as
    from the rows: exact."""
    def embedding_model(optimizer):
        keras.utils.set_random_seed(2)
        net = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(50, 6, name="table"),
                                keras.layers.Flatten(), keras.layers.Dense(3)])
        net.compile(optimizer=optimizer, loss="mse")
        return net
    ids = np.random.default_rng(3).integers(0, 50, size=(EXAMPLES, 4))
    _, y = data()
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    for optimizer in (keras.optimizers.Adam(0.01), keras.optimizers.RMSprop(0.01),
                      keras.optimizers.Adam(0.01, clipnorm=1.0), keras.optimizers.SGD(0.1, global_clipnorm=0.01)):
        with strategy.scope():
            net = embedding_model(optimizer)
        before = net.get_weights()
        with pytest.raises(UserError) as refused:
            train(net, ids, y, batch_size=BATCH, shuffle=False, verbose=0, zero_stage=1, export=())
        assert f"cannot shard {type(optimizer).__name__} for the Embedding layer 'table'" in str(refused.value)
        close(net.get_weights(), before, 0)
    reference = embedding_model(keras.optimizers.SGD(0.1, momentum=0.9))
    reference.fit(ids, y, batch_size=BATCH, shuffle=False, verbose=0)
    with strategy.scope():
        net = embedding_model(keras.optimizers.SGD(0.1, momentum=0.9))
    train(net, ids, y, batch_size=BATCH, shuffle=False, verbose=0, zero_stage=2, export=())
    close(net.get_weights(), reference.get_weights(), 1e-5)


class _Halving(keras.optimizers.schedules.LearningRateSchedule):  # Not registered with Keras.
    def __call__(self, step):
        return 0.1 * keras.ops.power(0.5, keras.ops.cast(step // 5, "float32"))


def test_a_schedule_keras_cannot_rebuild_is_shared_and_what_cannot_be_sharded_is_refused():
    expected = keras_weights(lambda: keras.optimizers.SGD(_Halving(), momentum=0.5))
    net, _ = sharded_fit(2, lambda: keras.optimizers.SGD(_Halving(), momentum=0.5), 1)
    close(net.get_weights(), expected, 1e-5)
    refused(r"zero_stage cannot shard Adafactor: each replica updates an equal flat 1/N of the weights' "
            r"elements, .* its factored second moments", stage=1, optimizer=lambda: keras.optimizers.Adafactor(0.1))

    class OwnStep(keras.optimizers.SGD):
        def update_step(self, gradient, variable, learning_rate):
            super().update_step(gradient / keras.ops.norm(gradient), variable, learning_rate)
    refused(r"zero_stage cannot shard OwnStep: .* its update_step is not one of Keras' elementwise", stage=2,
            optimizer=lambda: OwnStep(0.1))
    ema = lambda: keras.optimizers.SGD(0.1, use_ema=True)  # noqa: E731
    refused(r"cannot run keras.callbacks.SwapEMAWeights", stage=1, optimizer=ema,
            callbacks=[keras.callbacks.SwapEMAWeights()])

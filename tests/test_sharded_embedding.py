"""tfdist.layers.ShardedEmbedding and its row-sparse updates (tfdist.training.sparse_updates).

Against Keras' own `Embedding` with the same table and batches (float32): equal
after 20 SGD steps with 1, 2 and 4 shards, in one process and under a real
parameter-server job with one worker; Adagrad's sparse update equal to Keras';
the "lazy" Adam choice against a NumPy reference of its rule; checkpoints that
resume on another shard count; model.keras and the SavedModel serving without
a cluster; and the errors for bad ids, shard counts and shapes.
"""

import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tests.conftest import REPO
from tfdist.errors import UserError
from tfdist.layers import ShardedEmbedding
from tfdist.layers.sharded_embedding import row_split

ROWS, DIM, NUM, BATCH = 50, 8, 320, 16
PROGRAM = os.path.join(REPO, "tests", "programs", "sharded_ps.py")


def data(rows=ROWS):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, rows, size=(NUM, 3)).astype("int32")
    return ids, rng.normal(size=(NUM, 1)).astype("float32"), rng.normal(size=(rows, DIM)).astype("float32")


def build(embedding, optimizer):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,), dtype="int32"), embedding, keras.layers.Flatten(),
                              keras.layers.Dense(1, kernel_initializer="ones")])
    model.compile(optimizer, "mse")
    return model


def keras_reference(optimizer, regularizer=None):
    """Keras' own Embedding and model.fit: the table and Dense kernel after one epoch of 20 steps."""
    ids, y, table = data()
    model = build(keras.layers.Embedding(ROWS, DIM, weights=[table], embeddings_regularizer=regularizer), optimizer)
    model.fit(ids, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model.layers[0].get_weights()[0], model.layers[-1].get_weights()[0], model


def strategy():
    return tfdist.make_strategy("default", precision="float32")


@pytest.mark.parametrize("shards, regularizer", [(1, None), (2, None), (4, None), (3, "l2")])
def test_sgd_with_any_shard_count_trains_as_keras_embedding(shards, regularizer):
    table_ref, dense_ref, _ = keras_reference(keras.optimizers.SGD(0.1), regularizer)
    ids, y, table = data()
    model = build(ShardedEmbedding(ROWS, DIM, weights=[table], num_shards=shards,
                                   embeddings_regularizer=regularizer), keras.optimizers.SGD(0.1))
    assert [s.shape[0] for s in model.layers[0].shards] == row_split(ROWS, shards)
    history = tfdist.fit(model, ids, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, strategy=strategy())
    assert history.history["loss"][0] > 0
    np.testing.assert_allclose(model.layers[0].table(), table_ref, atol=1e-6)
    np.testing.assert_allclose(model.layers[-1].get_weights()[0], dense_ref, atol=1e-6)
    assert np.abs(table_ref - table).max() > 1e-2  # The table did train.


def test_adagrad_sparse_update_equals_keras_and_lazy_adam_follows_its_rule():
    table_ref, _, reference = keras_reference(keras.optimizers.Adagrad(0.1))
    ids, y, table = data()
    model = build(ShardedEmbedding(ROWS, DIM, weights=[table], num_shards=3), keras.optimizers.Adagrad(0.1))
    tfdist.fit(model, ids, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, strategy=strategy())
    np.testing.assert_allclose(model.layers[0].table(), table_ref, atol=1e-6)
    slots = np.concatenate([np.asarray(model.optimizer._accumulators[model.optimizer._get_variable_index(s)])
                            for s in model.layers[0].shards])
    keras_slot = reference.optimizer._accumulators[reference.optimizer._get_variable_index(
        reference.layers[0].embeddings)]
    np.testing.assert_allclose(slots, np.asarray(keras_slot), atol=1e-5)



def lazy_adam_reference(ids, y, table, lr=0.01, b1=0.9, b2=0.999, eps=1e-7):
    """TensorFlow 1's LazyAdam on the table of `frozen_head_model` (prediction = sum of the looked-up rows)."""
    w, m, v = table.astype(np.float64), np.zeros(table.shape), np.zeros(table.shape)
    for step in range(len(ids) // BATCH):
        xb, yb = ids[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH, 0]
        pred = w[xb].sum(axis=(1, 2))
        grad = np.zeros_like(w)
        np.add.at(grad, xb.reshape(-1), np.repeat(2 * (pred - yb) / BATCH, xb.shape[1])[:, None])
        rows, t = np.unique(xb), step + 1
        m[rows] = b1 * m[rows] + (1 - b1) * grad[rows]
        v[rows] = b2 * v[rows] + (1 - b2) * grad[rows] ** 2
        w[rows] -= lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m[rows] / (np.sqrt(v[rows]) + eps)
    return w


def frozen_head_model(embedding, optimizer):
    keras.utils.set_random_seed(1)
    head = keras.layers.Dense(1, kernel_initializer="ones", trainable=False)
    model = keras.Sequential([keras.Input((3,), dtype="int32"), embedding, keras.layers.Flatten(), head])
    model.compile(optimizer, "mse")
    return model


def test_lazy_adam_follows_its_documented_rule():
    ids, y, table = data()
    table = table * 0.1
    model = frozen_head_model(ShardedEmbedding(ROWS, DIM, weights=[table], num_shards=2, sparse_updates="lazy"),
                              keras.optimizers.Adam(0.01))
    tfdist.fit(model, ids, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, strategy=strategy())
    np.testing.assert_allclose(model.layers[0].table(), lazy_adam_reference(ids, y, table), atol=2e-5)


def test_lazy_adam_leaves_rows_not_looked_up_where_keras_adam_keeps_moving_them():
    ids, y, table = data()
    first, second = ids[:BATCH] % 10, ids[BATCH:2 * BATCH] % 10 + 10  # Rows 0-9, then rows 10-19.
    for mode, moves_again in (("lazy", False), ("exact", True)):
        model = build(ShardedEmbedding(ROWS, DIM, weights=[table], num_shards=2, sparse_updates=mode),
                      keras.optimizers.Adam(0.01))
        tfdist.fit(model, first, y[:BATCH], batch_size=BATCH, epochs=1, verbose=0, strategy=strategy())
        after_first = model.layers[0].table()
        tfdist.fit(model, second, y[:BATCH], batch_size=BATCH, epochs=1, verbose=0, strategy=strategy())
        moved = np.abs(model.layers[0].table()[:10] - after_first[:10]).max()
        assert (moved > 0) == moves_again, (mode, moved)
        assert np.abs(model.layers[0].table()[20:] - table[20:]).max() == 0  # Never looked up, never moved.


class Snapshot(keras.callbacks.Callback):
    """At the start of training (after any restore): the table and its Adam slots; stops after epoch 1 if asked."""

    def __init__(self, stop=False):
        super().__init__()
        self.stop, self.seen = stop, None

    def on_train_begin(self, logs=None):
        opt, shards = self.model.optimizer, self.model.layers[0].shards
        self.seen = {"table": self.model.layers[0].table(), "iterations": int(opt.iterations.numpy()),
                     **{name: np.concatenate([np.asarray(getattr(opt, name)[opt._get_variable_index(s)])
                                              for s in shards]) for name in ("_momentums", "_velocities")}}

    def on_epoch_end(self, epoch, logs=None):
        self.model.stop_training = self.stop


def test_a_run_resumes_exactly_on_another_shard_count(tmp_path):
    ids, y, table = data()
    workdir = str(tmp_path / "run")

    def run(shards, stop, rows=ROWS):
        model = build(ShardedEmbedding(rows, DIM, weights=[table] if rows == ROWS else None, num_shards=shards,
                                       sparse_updates="lazy"), keras.optimizers.Adam(0.01))
        snapshot = Snapshot(stop)
        tfdist.fit(model, ids, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, strategy=strategy(),
                   workdir=workdir, callbacks=[snapshot])
        return model, snapshot

    two, _ = run(2, stop=True)  # Epoch 1 on 2 shards; its checkpoint is at step 20.
    after_one = Snapshot()
    after_one.set_model(two)
    after_one.on_train_begin()
    three, restored = run(3, stop=False)  # Restored into 3 shards, then epoch 2.
    assert [s.shape[0] for s in three.layers[0].shards] == [17, 17, 16]
    assert restored.seen["iterations"] == 20
    for key, value in after_one.seen.items():
        np.testing.assert_array_equal(restored.seen[key], value, err_msg=key)
    straight = build(ShardedEmbedding(ROWS, DIM, weights=[table], num_shards=2, sparse_updates="lazy"),
                     keras.optimizers.Adam(0.01))
    tfdist.fit(straight, ids, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, strategy=strategy())
    np.testing.assert_allclose(three.layers[0].table(), straight.layers[0].table(), atol=1e-6)
    with pytest.raises(UserError, match=r"Cannot resume from .*ckpt-40: it does not hold this model and optimizer"):
        run(2, stop=False, rows=ROWS + 1)


def test_model_keras_loads_into_one_shard_and_serves_as_trained(tmp_path):
    ids, y, table = data()
    inputs = {"user": keras.Input((1,), dtype="int32", name="user"), "item": keras.Input((2,), dtype="int32",
                                                                                          name="item")}
    shared = ShardedEmbedding(ROWS, DIM, num_shards=4, mask_zero=True)  # Two id features, one table.
    pooled = [keras.layers.GlobalAveragePooling1D()(shared(inputs[k])) for k in ("user", "item")]
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Concatenate()(pooled)))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    ids = ids % (ROWS - 1) + 1  # No padding id: a fully masked user would average to 0/0.
    x = {"user": ids[:, :1], "item": ids[:, 1:]}
    tfdist.fit(model, x, y, batch_size=BATCH, epochs=1, verbose=0, strategy=strategy(), workdir=str(tmp_path / "r"),
               export=("keras", "saved_model"))
    expected = model.predict(x, verbose=0)
    loaded = keras.models.load_model(tmp_path / "r" / "model.keras")
    assert len(loaded.get_layer(shared.name).shards) == 4
    np.testing.assert_allclose(loaded.predict(x, verbose=0), expected, atol=1e-5)
    config = dict(shared.get_config(), num_shards=None)  # Built outside any cluster: one shard.
    single = ShardedEmbedding.from_config(config)
    single.build(None)
    single.load_own_variables({"0": shared.table()})
    assert len(single.shards) == 1
    np.testing.assert_array_equal(single.table(), shared.table())
    served = tf.saved_model.load(str(tmp_path / "r" / "saved_model")).signatures["serving_default"]
    out = served(user=tf.constant(x["user"]), item=tf.constant(x["item"]))
    np.testing.assert_allclose(next(iter(out.values())).numpy(), expected, atol=1e-5)
    # mask_zero: Keras' Embedding mask.
    np.testing.assert_array_equal(shared.compute_mask(tf.constant([[0, 3]])).numpy(), [[False, True]])


def test_bad_ids_and_shard_counts_get_one_paragraph_errors(tmp_path):
    ids, y, table = data()
    model = build(ShardedEmbedding(ROWS, DIM, num_shards=2, name="items"), keras.optimizers.SGD(0.1))
    bad = ids.copy()
    bad[40, 1] = ROWS + 7
    bad[41, 0] = -2
    with pytest.raises(UserError) as e:
        tfdist.fit(model, bad, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, strategy=strategy(),
                   workdir=str(tmp_path / "r"), checkpoint_every_steps=1)
    assert str(e.value) == (
        "tfdist.layers.ShardedEmbedding 'items' (input_dim=50) got ids outside 0..49: this batch's ids range from "
        "-2 to 57. Keras' Embedding would fail the same way on a CPU and return zeros on a GPU; map the ids into "
        "0..49 (e.g. with keras.layers.IntegerLookup or keras.layers.Hashing) or raise input_dim.")
    assert os.path.exists(tmp_path / "r" / "checkpoints" / "ckpt-2.index")  # The steps before it are kept.
    with pytest.raises(UserError, match=r"ShardedEmbedding t: num_shards=51 cannot split a table of 50 rows; give "
                                         r"a whole number from 1 to 50 \(each shard holds at least one row\)\."):
        ShardedEmbedding(ROWS, DIM, num_shards=51, name="t")
    with pytest.raises(UserError, match="num_shards=0 cannot split"):
        ShardedEmbedding(ROWS, DIM, num_shards=0)
    with pytest.raises(UserError, match="sparse_updates='eager'; give one of 'exact', 'lazy'"):
        ShardedEmbedding(ROWS, DIM, sparse_updates="eager")
    layer = ShardedEmbedding(ROWS, DIM, num_shards=2, name="t2")
    layer.build(None)
    with pytest.raises(UserError, match=r"ShardedEmbedding t2: a table of shape \(40, 8\) cannot be loaded into "
                                         r"this layer, whose table is \(50, 8\)\."):
        layer.load_own_variables({"0": np.zeros((40, DIM), "float32")})
    lazy_rmsprop = build(ShardedEmbedding(ROWS, DIM, sparse_updates="lazy", name="t3"),
                         keras.optimizers.RMSprop(0.1))
    with pytest.raises(UserError, match="ShardedEmbedding 't3' asks for sparse_updates='lazy', which tfdist "
                                        "implements for keras.optimizers.SGD"):
        tfdist.fit(lazy_rmsprop, ids, y, batch_size=BATCH, verbose=0, strategy=strategy())
    assert lazy_rmsprop.optimizer.iterations.numpy() == 0


def test_a_parameter_server_job_trains_each_shard_count_as_keras_and_places_rows_on_every_ps(tmp_path):
    import subprocess

    from tests.conftest import subprocess_env

    result = subprocess.run([sys.executable, "-m", "tfdist.cli.launch", "--num_workers=1", "--num_ps=2", "--",
                             sys.executable, PROGRAM, str(tmp_path)], capture_output=True, text=True, timeout=400,
                            cwd=REPO, env=subprocess_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = np.load(tmp_path / "chief.npz")
    table_ref, dense_ref, _ = keras_reference(keras.optimizers.SGD(0.1))
    for name in ("sgd1", "sgd2", "sgd4"):
        np.testing.assert_allclose(got[f"{name}_table"], table_ref, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(got[f"{name}_dense"], dense_ref, atol=1e-6, err_msg=name)
    adagrad_ref, _, reference = keras_reference(keras.optimizers.Adagrad(0.1))
    np.testing.assert_allclose(got["adagrad_table"], adagrad_ref, atol=1e-6)
    keras_slot = reference.optimizer._accumulators[reference.optimizer._get_variable_index(
        reference.layers[0].embeddings)]
    np.testing.assert_allclose(got["adagrad_slots"], np.asarray(keras_slot), atol=1e-5)
    # Placement: by default one shard per ps task, each with its share of the rows and its optimizer slot.
    assert list(got["adagrad_rows"]) == [25, 25]
    tasks = [d.split("/device:")[0] for d in got["adagrad_devices"]]
    assert sorted(tasks) == ["/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1"], tasks
    assert [d.split("/device:")[0] for d in got["adagrad_slot_devices"]] == tasks
    assert sorted({d.split("/device:")[0] for d in got["sgd4_devices"]}) == sorted(tasks)  # 2 shards on each.
    assert list(got["sgd4_rows"]) == [13, 13, 12, 12]
    for device in list(got["sgd4_devices"]) + list(got["adagrad_devices"]):
        assert "/job:ps/" in device, device  # No shard on the chief or a worker.
    # The export serves without a cluster: SavedModel predictions equal the trained model's.
    ids, _, _ = data()
    served = tf.saved_model.load(str(tmp_path / "adagrad" / "saved_model")).signatures["serving_default"]
    out = next(iter(served(tf.constant(ids)).values())).numpy()
    np.testing.assert_allclose(out, got["predicted"], atol=1e-5)
    output = result.stdout + result.stderr
    warning = "keras.layers.Embedding 'plain_items' (50 x 8, 0.0 MB) reads its whole table from the parameter servers"
    assert output.count(warning) == 1, output[-3000:]  # Once, for the one plain Embedding trained twice.
    assert output.count("reads its whole table") == 1  # None for the sharded tables.


def test_a_dense_update_of_a_large_table_is_named_once(caplog):
    from tfdist.training import sparse_updates

    rows = sparse_updates.LARGE_TABLE_BYTES // (4 * DIM)
    model = build(ShardedEmbedding(rows, DIM, num_shards=2, name="big"), keras.optimizers.Adam(0.01))
    exact = build(ShardedEmbedding(rows, DIM, num_shards=2, name="big_sgd"), keras.optimizers.SGD(0.01))
    with caplog.at_level("WARNING", logger="absl"):
        for _ in range(2):
            sparse_updates.check(model)
        sparse_updates.check(exact)
    messages = [r.getMessage() for r in caplog.records if "updates every row" in r.getMessage()]
    assert messages == [f"ShardedEmbedding 'big' ({rows} x {DIM}, 16 MB): Adam updates every row of the table (and its "
                        "slots) at every step, as Keras does. For row-sparse updates use SGD without momentum or "
                        "Adagrad (exact), or sparse_updates='lazy' with momentum SGD or Adam "
                        "(docs/sharded-embeddings.md)."], messages


@pytest.mark.parametrize("optimizer, mode", [("sgd", "exact"), ("adagrad", "exact"), ("adam", "lazy")])
def test_two_mirrored_replicas_train_as_one_device(optimizer, mode):
    """The all-reduced rows (IndexedSlices) and the per-replica row updates give one device's result."""
    ids, y, table = data()
    make = {"sgd": lambda: keras.optimizers.SGD(0.1), "adagrad": lambda: keras.optimizers.Adagrad(0.1),
            "adam": lambda: keras.optimizers.Adam(0.01)}[optimizer]
    one = build(ShardedEmbedding(ROWS, DIM, weights=[table], num_shards=2, sparse_updates=mode), make())
    tfdist.fit(one, ids, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, strategy=strategy())
    mirrored = tfdist.make_strategy("mirrored", num_cpu_replicas=2, all_reduce="reduce_to_one", precision="float32")
    with mirrored.scope():
        two = build(ShardedEmbedding(ROWS, DIM, weights=[table], num_shards=2, sparse_updates=mode), make())
    tfdist.fit(two, ids, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, strategy=mirrored)
    np.testing.assert_allclose(two.layers[0].table(), one.layers[0].table(), atol=1e-5)
    assert np.abs(one.layers[0].table() - table).max() > 1e-3


def test_a_resume_on_two_mirrored_replicas_restores_every_replica_of_the_table(tmp_path):
    ids, y, table = data()
    workdir = str(tmp_path / "run")
    mirrored = tfdist.make_strategy("mirrored", num_cpu_replicas=2, all_reduce="reduce_to_one", precision="float32")
    from tfdist.distribute.strategies import backend_of

    def run(stop):
        with mirrored.scope():
            model = build(ShardedEmbedding(ROWS, DIM, weights=[table], num_shards=2, sparse_updates="lazy"),
                          keras.optimizers.Adam(0.01))
        snapshot = Snapshot(stop)
        tfdist.fit(model, ids, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, strategy=mirrored,
                   workdir=workdir, callbacks=[snapshot])
        return model

    run(stop=True)
    model = run(stop=False)
    backend = backend_of(mirrored)
    opt = model.optimizer
    for shard in model.layers[0].shards:
        for variable in (shard, opt._momentums[opt._get_variable_index(shard)]):
            first, second = backend.local_replica_values(variable)
            np.testing.assert_array_equal(first, second)
    straight = build(ShardedEmbedding(ROWS, DIM, weights=[table], num_shards=2, sparse_updates="lazy"),
                     keras.optimizers.Adam(0.01))
    tfdist.fit(straight, ids, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, strategy=strategy())
    np.testing.assert_allclose(model.layers[0].table(), straight.layers[0].table(), atol=1e-5)


def test_lazy_updates_with_a_custom_train_step_are_refused():
    class OwnStep(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
            return {"loss": loss}

    ids, y, _ = data()
    keras.utils.set_random_seed(1)
    model = OwnStep([keras.Input((3,), dtype="int32"), ShardedEmbedding(ROWS, DIM, sparse_updates="lazy", name="own"),
                     keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.01), "mse")
    with pytest.raises(UserError, match="ShardedEmbedding 'own': sparse_updates='lazy' applies to tfdist's own "
                                        "training step"):
        tfdist.fit(model, ids, y, batch_size=BATCH, verbose=0, strategy=strategy())

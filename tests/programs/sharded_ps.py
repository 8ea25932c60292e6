"""ShardedEmbedding under a parameter-server job with one worker (the order of the steps is then fixed).

Trains, with SGD and float32, the same model with 1, 2 and 4 shards (and Adagrad with the default count,
one shard per ps task), 20 steps each, and writes to OUT/chief.npz the trained tables, the devices of
every shard and slot, and the predictions of the exported SavedModel; the test compares with Keras.
"""

import os
import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tfdist.layers import ShardedEmbedding

ROWS, DIM, NUM, BATCH = 50, 8, 320, 16


def data() -> tuple:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ROWS, size=(NUM, 3)).astype("int32")
    return ids, rng.normal(size=(NUM, 1)).astype("float32"), rng.normal(size=(ROWS, DIM)).astype("float32")


def build(embedding: keras.layers.Layer, optimizer: keras.optimizers.Optimizer) -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,), dtype="int32"), embedding, keras.layers.Flatten(),
                              keras.layers.Dense(1, kernel_initializer="ones")])
    model.compile(optimizer, "mse")
    return model


def main() -> None:
    out = sys.argv[1]
    strategy = tfdist.make_strategy("auto", precision="float32")  # Workers and ps tasks serve here and exit.
    ids, y, table = data()
    results = {}
    for name, shards, optimizer in (("sgd1", 1, "sgd"), ("sgd2", 2, "sgd"), ("sgd4", 4, "sgd"),
                                    ("adagrad", None, "adagrad")):
        with strategy.scope():
            model = build(ShardedEmbedding(ROWS, DIM, weights=[table], num_shards=shards),
                          keras.optimizers.SGD(0.1) if optimizer == "sgd" else keras.optimizers.Adagrad(0.1))
        workdir = os.path.join(out, name) if name == "adagrad" else None
        # A dataset function in input order: with one worker, the steps run in that order.
        tfdist.fit(model, lambda context: tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH), batch_size=BATCH,
                   steps_per_epoch=NUM // BATCH, epochs=1, verbose=0, workdir=workdir, export=("keras", "saved_model"))
        layer = model.layers[0]
        results[f"{name}_table"] = layer.table()
        results[f"{name}_dense"] = model.layers[-1].get_weights()[0]
        results[f"{name}_devices"] = np.asarray([s.value.device for s in layer.shards])
        results[f"{name}_rows"] = np.asarray([s.shape[0] for s in layer.shards])
        if name == "adagrad":
            slots = [model.optimizer._accumulators[model.optimizer._get_variable_index(s)] for s in layer.shards]
            results["adagrad_slot_devices"] = np.asarray([s.value.device for s in slots])
            results["adagrad_slots"] = np.concatenate([np.asarray(s) for s in slots])
            results["predicted"] = tfdist.predict(model, ids, verbose=0)
    with strategy.scope():  # Keras' own Embedding: tfdist says, once, that it reads its whole table.
        plain = build(keras.layers.Embedding(ROWS, DIM, name="plain_items"), keras.optimizers.SGD(0.1))
    for _ in range(2):
        tfdist.fit(plain, ids, y, batch_size=BATCH, epochs=1, steps_per_epoch=2, verbose=0)
    np.savez(os.path.join(out, "chief.npz"), **results)


if __name__ == "__main__":
    main()

"""Run by tests/test_controller.py (alone or under tfdist-launch): one float16 step whose global batch
overflows on one replica only. Prints the loss scale before/after, whether the weights stayed
put and finite, and a weights hash every worker must share."""

import hashlib
import sys

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tfdist.mnist import data

options = {"num_cpu_replicas": 2} if sys.argv[1] == "mirrored" else {}
strategy = tfdist.make_strategy(sys.argv[1], precision="mixed_float16", **options)
digits = data.load_dataset("mnist")
x, y = digits.train_images[:64].astype("float32") / 255.0, digits.train_labels[:64]
# The example the topology-independent order puts in replica 1's half of global batch 0 (Keras alone
# would take replica 0's skip decision for everyone, so replica 1 is the one that tells).
first_of_replica_1 = int(tf.random.experimental.index_shuffle(
    tf.constant([32], tf.int64), seed=tf.constant([0, 0], tf.int64), max_index=63)[0])
x[first_of_replica_1] = 1e5
with strategy.scope():
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
before = [np.asarray(w) for w in model.get_weights()]
scale = float(model.optimizer.initial_scale)
tfdist.fit(model, x, y, batch_size=64, epochs=1, max_steps=1, verbose=0)
after = [np.asarray(w) for w in model.get_weights()]
unchanged = all(np.array_equal(a, b) for a, b in zip(before, after))
finite = all(np.isfinite(a).all() for a in after)
digest = hashlib.sha256(b"".join(a.tobytes() for a in after)).hexdigest()[:16]
print(f"scale {scale:g} -> {float(model.optimizer.dynamic_scale.numpy()):g} unchanged={unchanged} "
      f"finite={finite} weights={digest}", flush=True)

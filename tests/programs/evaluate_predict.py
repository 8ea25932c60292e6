"""tfdist.evaluate and tfdist.predict in a real multi-process job (MultiWorkerMirrored, parameter servers, Horovod).

The same script runs on every task (`make_strategy("auto")`). It trains two
steps, then evaluates and predicts 203 examples with batch 32 (a last batch
that needs padding) and writes, per task, the trained weights and what the
two calls returned to OUT/<task>.npz, so the test compares every task with
Keras' own evaluate and predict on those weights.
"""

import json
import os
import sys

import keras
import numpy as np

import tfdist

NUM, BATCH = 203, 32


def data() -> tuple:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM, 5)).astype("float32")
    y = {"a": rng.integers(0, 3, NUM).astype("int32"), "b": x.sum(axis=1, keepdims=True)}
    return x, y, rng.uniform(0.1, 2.0, NUM).astype("float32")


def build() -> keras.Model:
    """Two outputs: a class (cross-entropy, accuracy) and a value (mse, mae)."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,), name="x")
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = {"a": keras.layers.Dense(3, name="a")(hidden), "b": keras.layers.Dense(1, name="b")(hidden)}
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss={"a": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "b": "mse"},
                  metrics={"a": ["accuracy"], "b": ["mae"]})
    return model


def task() -> str:
    if "HOROVOD_RANK" in os.environ:
        return f"rank{os.environ['HOROVOD_RANK']}"
    spec = json.loads(os.environ["TF_CONFIG"])["task"]
    return f"{spec['type']}{spec['index']}"


def main() -> None:
    out = sys.argv[1]
    strategy = tfdist.make_strategy("auto", precision="float32")  # Parameter-server workers serve here and exit.
    with strategy.scope():
        model = build()
    x, y, weight = data()
    tfdist.fit(model, x[:128], {k: v[:128] for k, v in y.items()}, batch_size=64, verbose=0)
    listed = tfdist.evaluate(model, x, y, sample_weight=weight, verbose=0, steps_per_execution=3)
    logs = tfdist.evaluate(model, x, y, sample_weight=weight, verbose=0, return_dict=True)
    predicted = tfdist.predict(model, x, verbose=0, steps_per_execution=3)
    np.savez(os.path.join(out, f"{task()}.npz"), listed=np.asarray(listed), names=np.asarray(sorted(logs)),
             values=np.asarray([logs[k] for k in sorted(logs)]), a=predicted["a"], b=predicted["b"],
             **{f"w{i}": w for i, w in enumerate(model.get_weights())})
    print(f"[{task()}] evaluated and predicted {len(predicted['a'])} examples", flush=True)


if __name__ == "__main__":
    main()

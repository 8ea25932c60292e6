"""Models and data of the Keras forms issue 29 found broken, shared by the one-process and the job tests.

- `siamese`: two inputs passed as a list (``x=[left, right]``), a shared encoder and a
  ``BatchNormalization(synchronized=True)`` on the distance, as keras.io's Siamese examples;
- `endpoint`: no ``y``: the loss comes from an endpoint layer's ``add_loss`` on targets fed as an input;
- `embedding`: an ``Embedding`` whose sparse gradients repeat rows (bit-identical workers);
- `sparse_input`: a ``SparseTensor`` input (Keras' embedding_lookup_sparse kernel gradient: each task's own
  unique rows, gathered and merged) with Adagrad;
- `SIAMESE_X`/`SIAMESE_Y`, `ENDPOINT_X`, `IDS`/`IDS_Y`: their data (float32, fixed seeds).

Plain SGD in float32 everywhere, so a wrong gradient scale shows against Keras' own fit.
"""

import keras
import numpy as np

RNG = np.random.default_rng(29)
SIAMESE_X = [RNG.normal(size=(128, 6)).astype("float32") * 2 + 1, RNG.normal(size=(128, 6)).astype("float32")]
SIAMESE_Y = (np.abs(SIAMESE_X[0] - SIAMESE_X[1]).sum(1) > 9).astype("float32")
ENDPOINT_X = {"features": RNG.normal(size=(128, 5)).astype("float32"),
              "targets": (RNG.random((128, 1)) > 0.5).astype("float32")}
IDS = RNG.integers(0, 2000, size=(4096, 40)).astype("int32")
IDS_Y = (IDS.sum(1) % 2).astype("int64")
SPARSE_X = ((RNG.random((96, 30)) > 0.8) * RNG.random((96, 30))).astype("float32")
SPARSE_Y = RNG.random((96, 3)).astype("float32")


def siamese(synchronized=True):
    init = keras.initializers.GlorotUniform
    left, right = keras.Input((6,), name="left"), keras.Input((6,), name="right")
    encoder = keras.layers.Dense(8, activation="tanh", kernel_initializer=init(0))
    distance = keras.layers.Lambda(lambda pair: keras.ops.abs(pair[0] - pair[1]))([encoder(left), encoder(right)])
    normal = keras.layers.BatchNormalization(synchronized=synchronized)(distance)
    output = keras.layers.Dense(1, activation="sigmoid", kernel_initializer=init(1))(normal)
    model = keras.Model([left, right], output)
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss="binary_crossentropy", metrics=["accuracy"])
    return model


class Endpoint(keras.layers.Layer):
    """keras.io's endpoint layer pattern: the loss from the targets, added with add_loss; predictions out."""

    def call(self, targets, logits):
        self.add_loss(keras.ops.mean(keras.losses.binary_crossentropy(targets, logits, from_logits=True)))
        return keras.ops.sigmoid(logits)


def endpoint():
    features, targets = keras.Input((5,), name="features"), keras.Input((1,), name="targets")
    logits = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(2))(features)
    model = keras.Model({"features": features, "targets": targets}, Endpoint()(targets, logits))
    model.compile(optimizer=keras.optimizers.SGD(0.5))
    return model


def embedding():
    model = keras.Sequential([
        keras.Input((40,), dtype="int32"),
        keras.layers.Embedding(2000, 64, embeddings_initializer=keras.initializers.RandomUniform(seed=3)),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(4))])
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def sparse_input():
    model = keras.Sequential([keras.Input((30,), sparse=True),
                              keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(5))])
    model.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="mse")
    return model


def fit_sparse(fit, model):
    import tensorflow as tf

    return fit(model, tf.sparse.from_dense(SPARSE_X), SPARSE_Y, batch_size=16, epochs=2, shuffle=False, verbose=0)


def fit_siamese(fit, model, **kwargs):
    return fit(model, SIAMESE_X, SIAMESE_Y, batch_size=32, epochs=2, shuffle=False, verbose=0, **kwargs)


def fit_endpoint(fit, model, batch_size=32, **kwargs):
    return fit(model, ENDPOINT_X, batch_size=batch_size, epochs=2, shuffle=False, verbose=0, **kwargs)


def keras_fit(model, *args, **kwargs):
    """Keras' own fit, called as `tfdist.fit` is (model first)."""
    return model.fit(*args, **kwargs)


def check_job(out):
    """Checks what tests/programs/keras_forms.py wrote in `out`: both tasks against Keras' own fit on one device.

    The Siamese and endpoint weights and logs within 1e-5 of Keras' (list inputs, synchronized
    BatchNormalization over the global batch, no y, a batch of 7 the tasks do not divide); the Embedding model bit
    for bit alike on both tasks (and trained); the sparse-input model Keras' and alike on both; each task's own
    initial-weights file.
    """
    import json
    import os

    siamese_ref, endpoint_ref, uneven_ref, sparse_ref = siamese(), endpoint(), endpoint(), sparse_input()
    expected = {"siamese": fit_siamese(keras_fit, siamese_ref).history,
                "endpoint": fit_endpoint(keras_fit, endpoint_ref, validation_data=(ENDPOINT_X,)).history,
                "uneven": fit_endpoint(keras_fit, uneven_ref, batch_size=7).history,
                "sparse": fit_sparse(keras_fit, sparse_ref).history}
    wanted = siamese_ref.get_weights() + endpoint_ref.get_weights() + uneven_ref.get_weights()
    start = embedding().get_weights()
    tasks = [np.load(os.path.join(out, f"task{i}.npz")) for i in (0, 1)]
    for saved in tasks:
        got = [saved[f"arr_{i}"] for i in range(len(wanted))]
        for a, b in zip(got, wanted):
            np.testing.assert_allclose(a, b, atol=1e-5)
        history = json.loads(str(saved["history"]))
        for model in expected:
            assert set(history[model]) == set(expected[model]), (history, expected)
            for key, values in expected[model].items():
                np.testing.assert_allclose(history[model][key], values, atol=1e-5, err_msg=f"{model} {key}")
    tables = [[saved[f"arr_{len(wanted) + i}"] for i in range(len(start))] for saved in tasks]
    for a, b in zip(*tables):
        np.testing.assert_array_equal(a, b)  # Equal bits, not close.
    assert np.abs(tables[0][0] - start[0]).max() > 1e-3  # The table trained.
    first = len(wanted) + len(start)  # The sparse-input model: Keras' weights, equal bits on both tasks.
    sparse = [[saved[f"arr_{first + i}"] for i in range(len(sparse_ref.weights))] for saved in tasks]
    for a, b, c in zip(*sparse, sparse_ref.get_weights()):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, atol=1e-5)
    names = sorted(str(saved["initial"]) for saved in tasks)
    assert [os.path.basename(n) for n in names] == ["initial_weights.task1.weights.h5", "initial_weights.weights.h5"]
    assert all(os.path.exists(n) for n in names)

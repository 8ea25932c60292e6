"""tfdist.training.inputs: the topology-independent training order and exact evaluation, on real digits; and
the input forms Keras takes (optional inputs given None, 1-D arrays and datasets for inputs of shape (1,), dicts
keyed as the model was built, generator batches of different lengths), each against Keras on 2 replicas."""

import hashlib

import numpy as np
import pytest
import tensorflow as tf

from tfdist.mnist import data
from tfdist.training import inputs

DIGITS = data.load_dataset("mnist")
ARRAYS = inputs.Arrays(DIGITS.train_images, DIGITS.train_labels)
STEPS = DIGITS.num_train // 128


def keys(images):
    return [hashlib.sha1(np.asarray(im).tobytes()).hexdigest() for im in images]


def global_batches(pipelines, replicas, *, start=0, steps=STEPS, seed=1, total=None):
    """The global batch of every step, put together from every pipeline's replica batches in replica order."""
    per_replica = 128 // replicas
    fn = inputs.train_arrays_fn(ARRAYS, per_replica_batch=per_replica, steps_per_epoch=STEPS, seed=seed,
                                start_step=start, total_steps=total)
    here = replicas // pipelines
    streams = []
    for i in range(pipelines):
        dataset = fn(tf.distribute.InputContext(pipelines, i, replicas))
        assert [tuple(s.shape.as_list()) for s in dataset.element_spec] == [(per_replica, 28, 28, 1),
                                                                            (per_replica,)]
        streams.append([b[1].numpy() for b in dataset.take(steps * here)])
    return [np.concatenate([streams[p][s * here + j] for p in range(pipelines) for j in range(here)])
            for s in range(steps)]


def test_every_topology_trains_on_the_same_examples_at_every_step():
    one = global_batches(1, 1)
    for pipelines, replicas in ((1, 2), (1, 4), (2, 2), (2, 4), (4, 4)):
        other = global_batches(pipelines, replicas)
        assert len(other) == len(one) == STEPS
        for a, b in zip(one, other):
            np.testing.assert_array_equal(a, b)


def test_an_epoch_is_a_permutation_and_epochs_differ():
    fn = inputs.train_arrays_fn(ARRAYS, per_replica_batch=128, steps_per_epoch=STEPS, seed=1)
    dataset = fn(tf.distribute.InputContext())
    images = [b[0].numpy() for b in dataset.take(2 * STEPS)]
    first, second = np.concatenate(images[:STEPS]), np.concatenate(images[STEPS:])
    assert len(set(keys(first))) == len(first) == STEPS * 128  # No digit twice in an epoch.
    assert keys(first) != keys(second)
    seeded = [b[0].numpy() for b in inputs.train_arrays_fn(ARRAYS, per_replica_batch=128, steps_per_epoch=STEPS,
                                                            seed=2)(tf.distribute.InputContext()).take(1)]
    assert keys(seeded[0]) != keys(images[0])


def test_resume_skips_exactly_even_on_another_topology():
    full = global_batches(1, 1, steps=100, total=100)
    resumed = global_batches(2, 4, start=70, steps=30, total=100)
    assert len(resumed) == 30
    for a, b in zip(full[70:], resumed):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static-shapes"])
@pytest.mark.parametrize("pipelines, replicas_per_pipeline, n", [(1, 3, 1001), (2, 1, 999), (3, 2, 2000)])
def test_eval_counts_every_example_exactly_once(pipelines, replicas_per_pipeline, n, static):
    ids = np.arange(n)
    images = np.zeros((n, 28, 28, 1), np.uint8)
    images[:, 0, 0, 0], images[:, 0, 1, 0] = ids % 256, ids // 256
    per_replica, replicas = 64, pipelines * replicas_per_pipeline
    steps = inputs.eval_steps(n, per_replica, replicas)
    fn = inputs.eval_arrays_fn(inputs.Arrays(images, (ids % 10).astype(np.int32)), per_replica_batch=per_replica,
                               steps=steps, static_shapes=static)
    counted = []
    for i in range(pipelines):
        dataset = fn(tf.distribute.InputContext(pipelines, i, replicas))
        if static:
            assert all(None not in s.shape.as_list() for s in dataset.element_spec), dataset.element_spec
        batches = list(dataset)
        assert len(batches) == steps * replicas_per_pipeline  # Same count on every pipeline.
        for image, _, mask in batches:  # No sample weight given: none in the element.
            kept = image.numpy()[mask.numpy() > 0]
            assert (static and image.shape[0] == per_replica) or (not static and mask.numpy().all())
            counted += list(kept[:, 0, 0, 0].astype(int) + 256 * kept[:, 0, 1, 0].astype(int))
    assert sorted(counted) == list(range(n))


# Input forms Keras takes (issue 40), each against Keras' own fit/evaluate/predict on one device: the same initial
# weights and batches, plain SGD, float32, 1e-5, through tfdist on 2 replicas. 36 examples in batches of 8: the
# last batch is short, so the replicas' padding and splitting paths are taken too.
import keras  # noqa: E402

import tfdist  # noqa: E402

RNG = np.random.default_rng(40)
A = RNG.normal(size=(36, 4)).astype("float32")
B = RNG.normal(size=(36, 4)).astype("float32")
Y = RNG.normal(size=(36, 1)).astype("float32")
X1 = RNG.normal(size=(36,)).astype("float32")


class AddOptional(keras.layers.Layer):
    """x + o, or x where the optional input o is None."""

    def call(self, x, o=None):
        return x if o is None else x + o


def two_replicas():
    return tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", all_reduce="reduce_to_one")


def optional_model(structure):
    """Inputs x and an optional o, built with a list (`[x, o]`) or a dict (`{"x": x, "o": o}`)."""
    x, o = keras.Input((4,), name="x"), keras.Input((4,), name="o", optional=True)
    hidden = keras.layers.Dense(3, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(0))(
        AddOptional()(x, o))
    output = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(1))(hidden)
    model = keras.Model({"x": x, "o": o} if structure == "dict" else [x, o], output)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


def assert_like_keras(make_model, fit_x, fit_y=None, eval_x=None, eval_y=None, predict_x=None, **fit_kwargs):
    """fit (history and weights), evaluate and predict through tfdist on 2 replicas, against Keras on one device.
    The arguments may be functions (a fresh generator for each side)."""
    def given(value):
        return value() if callable(value) else value

    reference = make_model()
    strategy = two_replicas()
    with strategy.scope():
        model = make_model()
    fit_kwargs = {"epochs": 2, "shuffle": False, "verbose": 0, **fit_kwargs}
    expected = reference.fit(given(fit_x), given(fit_y), **fit_kwargs).history
    history = tfdist.fit(model, given(fit_x), given(fit_y), strategy=strategy, **fit_kwargs).history
    assert set(history) == set(expected), (history, expected)
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], atol=1e-5, err_msg=key)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    if eval_x is not None:
        np.testing.assert_allclose(tfdist.evaluate(model, given(eval_x), given(eval_y), verbose=0, strategy=strategy),
                                   reference.evaluate(given(eval_x), given(eval_y), verbose=0), atol=1e-5)
    if predict_x is not None:
        got, wanted = tfdist.predict(model, given(predict_x), verbose=0, strategy=strategy), \
            reference.predict(given(predict_x), verbose=0)
        assert got.shape == wanted.shape
        np.testing.assert_allclose(got, wanted, atol=1e-5)
    return model


@pytest.mark.parametrize("structure", ["list", "dict"])
def test_an_optional_input_given_none_trains_evaluates_and_predicts_as_keras(structure):
    """Today: refused ("x holds a scalar") in fit, evaluate and predict."""
    x = [A, None] if structure == "list" else {"x": A, "o": None}
    assert_like_keras(lambda: optional_model(structure), x, Y, eval_x=x, eval_y=Y, predict_x=x, batch_size=8,
                      validation_data=(x, Y))


def one_input_model():
    keras.utils.set_random_seed(0)
    x = keras.Input((4,), name="x")
    model = keras.Model(x, keras.layers.Dense(1)(x))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


@pytest.mark.parametrize("structure", ["one", "list", "dict"])
def test_a_required_input_given_none_is_refused_before_any_step_with_keras_reason(structure):
    """None for an Input that is not optional: Keras' own fit raises "The input 'x' is not optional, but None was
    passed..." (Keras' functional_test.py test_required_none_raises_in_fit); tfdist refuses it before any step with
    that sentence, naming the input, as a tfdist.UserError (a ValueError). Today: 'x holds no array (None alone)'
    for [None], and a failure inside the step's trace for [None, A] / {"x": None, "o": A}."""
    make = one_input_model if structure == "one" else lambda: optional_model(structure)
    x = {"one": [None], "list": [None, A], "dict": {"x": None, "o": A}}[structure]
    with pytest.raises(ValueError, match="not optional") as keras_error:
        make().fit(x, Y, epochs=1, verbose=0)
    with two_replicas().scope():
        model = make()
    before = model.get_weights()
    with pytest.raises(tfdist.UserError) as error:
        tfdist.fit(model, x, Y, epochs=1, verbose=0)
    assert isinstance(error.value, ValueError)
    assert str(keras_error.value) in str(error.value), (str(error.value), str(keras_error.value))
    assert int(model.optimizer.iterations) == 0
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_optional_input_given_none_by_a_generator_and_a_dataset_is_taken_as_keras():
    """Keras' own test_functional_optional_inputs_generator form: {"x": x, "o": None} batches from a generator;
    and a tf.data.Dataset holding the None (a `NoneTensorSpec`), cut into global batches. Today: a generator's
    batches cannot be given a spec, and a dataset's step takes the None as the batch."""
    def batches(with_y=True, sizes=(8, 8, 8, 8, 4)):
        start = 0
        for size in sizes:
            yield ({"x": A[start:start + size], "o": None},) + ((Y[start:start + size],) if with_y else ())
            start += size

    assert_like_keras(lambda: optional_model("dict"), batches, eval_x=batches, predict_x=lambda: batches(False),
                      epochs=1)
    dataset = tf.data.Dataset.from_tensor_slices(({"x": A, "o": None}, Y)).batch(8)
    assert_like_keras(lambda: optional_model("dict"), dataset, eval_x=dataset)


def column_model():
    """One input of shape (1,): Keras adds the last dimension to a 1-D array."""
    model = keras.Sequential([keras.Input((1,)),
                              keras.layers.Dense(3, activation="tanh",
                                                 kernel_initializer=keras.initializers.GlorotUniform(2)),
                              keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(3))])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


def test_one_dimensional_arrays_for_an_input_of_shape_1_evaluate_and_predict_as_keras():
    """Today: predict refuses the (36,) array ("which takes (examples, 1)")."""
    assert_like_keras(column_model, X1, Y, eval_x=X1, eval_y=Y, predict_x=X1, batch_size=8)


def test_a_batched_dataset_of_one_dimensional_features_is_batches_as_keras_takes_it():
    """`Dataset.from_tensor_slices(x1d).batch(8)`: batches of shape (8,), which Keras takes as batches (every
    tf.data.Dataset is); today fit refuses it as "single examples", and predict as the wrong shape."""
    dataset = tf.data.Dataset.from_tensor_slices((X1, Y)).batch(8)
    assert_like_keras(column_model, dataset, eval_x=dataset,
                      predict_x=tf.data.Dataset.from_tensor_slices(X1).batch(8))


def keyed_model():
    """Built with a dict whose keys ("a", "b") are not its Inputs' names: Keras matches x by the dict's keys."""
    a, b = keras.Input((4,), name="first_features"), keras.Input((4,), name="second_features")
    hidden = keras.layers.Concatenate()([a, keras.layers.Dense(4, kernel_initializer=keras.initializers.GlorotUniform(
        4))(b)])
    output = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(5))(hidden)
    model = keras.Model({"b": b, "a": a}, output)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_dict_inputs_keyed_as_the_model_was_built_match_keras():
    """Today: refused ("use one key per keras.Input, named as the Input's name") in fit, evaluate and predict.
    A model built with a list takes a dict keyed by Input names with more keys, as Keras (it takes the named ones);
    keys naming neither are still refused before any step."""
    x = {"a": A, "b": B}
    assert_like_keras(keyed_model, x, Y, eval_x=x, eval_y=Y, predict_x=x, batch_size=8)
    extra = {"x": A, "o": B, "unused": Y}
    assert_like_keras(lambda: optional_model("list"), extra, Y, eval_x=extra, eval_y=Y, predict_x=extra, batch_size=8)
    strategy = two_replicas()
    with strategy.scope():
        model = keyed_model()
    with pytest.raises(tfdist.UserError, match="keyed a, b"):
        tfdist.fit(model, {"first_features": A, "second_features": B}, Y, verbose=0, strategy=strategy)
    with pytest.raises(tfdist.UserError, match="keyed a, b"):
        tfdist.predict(model, {"a": A}, verbose=0, strategy=strategy)


def pooling_model():
    """Sequences of any length (Input (None, 1)), averaged: batches of different lengths are Keras' own case."""
    model = keras.Sequential([keras.Input((None, 1)), keras.layers.GlobalAveragePooling1D(),
                              keras.layers.Dense(2, activation="tanh",
                                                 kernel_initializer=keras.initializers.GlorotUniform(6)),
                              keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(7))])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def sequence_batches(with_y=True, shapes=((4, 16), (3, 8), (4, 12), (2, 8))):
    rng = np.random.default_rng(41)
    for size, length in shapes:
        x = rng.normal(size=(size, length, 1)).astype("float32")
        yield (x,) + ((x.mean(1) * 2,) if with_y else ())


def test_generator_batches_of_different_lengths_train_as_keras_and_held_out_ones_are_refused_before_any_step():
    """fit takes each batch of a generator as a step (one process), whose spec is read from its first batches as
    Keras reads it (today: the first batch's shape, so the second batch fails mid-epoch). Held-out batches are
    read into one array per input, so evaluate and predict refuse them in one paragraph (Keras' STFTSpectrogram
    test predicts (2, 16000, 1) and (3, 8000, 1)); today: numpy's concatenate error."""
    assert_like_keras(pooling_model, sequence_batches, epochs=1)
    strategy = two_replicas()
    with strategy.scope():
        model = pooling_model()
    with pytest.raises(tfdist.UserError, match=r"shapes differ beyond the first dimension .*\(16, 1\) and \(8, 1\)"):
        tfdist.predict(model, sequence_batches(False), verbose=0, strategy=strategy)
    with pytest.raises(tfdist.UserError, match="shapes differ beyond the first dimension"):
        tfdist.evaluate(model, sequence_batches(), verbose=0, strategy=strategy)
    with pytest.raises(tfdist.UserError, match="validation_data yields batches whose shapes differ"):
        tfdist.fit(model, sequence_batches(), validation_data=sequence_batches(), verbose=0, strategy=strategy)

"""Streams (tfdist.training.controller, sources.can_stream): inputs of unknown length read as they come.

A Python generator without steps_per_epoch, and a dataset of unknown length with steps_per_epoch, are read a
batch at a time on a single-controller backend (as Keras' fit reads them): an epoch ends after steps_per_epoch
steps or where the data ends, an endless generator trains until a callback stops it, and each batch (a short
last one included) is one step split over the replicas. Against Keras' own fit on one device, 2 replicas.
"""

import warnings

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tests.test_epochs import compiled, model_fn
from tests.test_fitting import MIRRORED, _Hooks, assert_same_calls

RNG = np.random.default_rng(11)
X, Y = RNG.normal(size=(38, 6)).astype("float32"), RNG.integers(0, 3, size=38)


def unknown_length():
    """38 examples in batches of 4 (the last of 2), of a length tf.data does not know."""
    return tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda x, y: True).batch(4)


def batches(endless=False):
    while True:
        for start in range(0, len(X), 4):
            yield X[start:start + 4], Y[start:start + 4]
        if not endless:
            return


def both(fit_args, execution=1, callbacks=lambda: []):
    """Keras' own fit on one device and tfdist.fit on 2 replicas: their hook calls, histories and models."""
    reference = compiled(model_fn(), execution)
    expected = _Hooks()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = reference.fit(**fit_args(), verbose=0, callbacks=[expected, *callbacks()])
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = compiled(model_fn(), execution)
    seen = _Hooks()
    got = tfdist.fit(model, **fit_args(), verbose=0, callbacks=[seen, *callbacks()])
    return (seen, got, model), (expected, history, reference)


def assert_as_keras(ours, theirs):
    (seen, got, model), (expected, history, reference) = ours, theirs
    assert_same_calls(seen.calls, expected.calls)
    assert sorted(got.history) == sorted(history.history)
    np.testing.assert_allclose(got.history["loss"], history.history["loss"], atol=1e-5)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_dataset_of_unknown_length_ends_epochs_where_its_data_ends_as_keras():
    """steps_per_epoch=4 over 10 batches: epochs of 4, 4, 2 (the data ended), then the data again; 2 steps an
    execution (compile): the execution that finds no data gets its begin hook only, as in Keras."""
    for spe, execution, ends in ((4, 1, [4, 4, 2, 4]), (4, 2, [2, 2, 1, 2]), (12, 2, [5, 5, 5, 5])):
        ours, theirs = both(lambda: {"x": unknown_length(), "epochs": 4, "steps_per_epoch": spe}, execution)
        assert_as_keras(ours, theirs)
        per_epoch, count = [], 0
        for call in ours[0].calls:
            count += call[0] == "train_end"
            if call[0] == "epoch_end":
                per_epoch, count = per_epoch + [count], 0
        assert per_epoch == ends, (spe, execution, per_epoch)


def test_a_generator_is_read_as_it_comes_its_short_last_batch_split_over_the_replicas():
    ours, theirs = both(lambda: {"x": batches(), "epochs": 1})
    assert_as_keras(ours, theirs)
    assert [c[1] for c in ours[0].calls if c[0] == "train_end"] == list(range(10))  # 10 batches, the last of 2.


class StopAfter(keras.callbacks.Callback):
    def __init__(self, batches):
        super().__init__()
        self.batches, self.seen = batches, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.batches:
            self.model.stop_training = True


def test_an_endless_generator_trains_until_a_callback_stops_it():
    ours, theirs = both(lambda: {"x": batches(endless=True), "epochs": 1}, callbacks=lambda: [StopAfter(13)])
    assert_as_keras(ours, theirs)
    assert sum(1 for c in ours[0].calls if c[0] == "train_end") == 13


def test_what_a_stream_cannot_do_is_refused_before_any_step(tmp_path):
    """A batch_size that would re-cut a stream's batches; resuming a stream whose epochs may have ended early
    (where its passes ended is not recorded); steps_per_epoch=0."""
    import pytest

    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    with strategy.scope():
        model = compiled(model_fn(), 1)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(tfdist.UserError, match=r"batch_size=8 cannot re-cut its batches \(the first holds 4"):
        tfdist.fit(model, batches(), batch_size=8, verbose=0)
    with pytest.raises(tfdist.UserError, match=r"steps_per_epoch=0 must be 1 or more"):
        tfdist.fit(model, unknown_length(), steps_per_epoch=0, verbose=0)
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    tfdist.fit(model, unknown_length(), steps_per_epoch=4, epochs=3, verbose=0, workdir=str(tmp_path / "run"))
    trained = [w.copy() for w in model.get_weights()]
    with pytest.raises(tfdist.UserError, match=r"Cannot resume the run .* where its passes ended"):
        tfdist.fit(model, unknown_length(), steps_per_epoch=4, epochs=3, verbose=0, workdir=str(tmp_path / "run"))
    for a, b in zip(model.get_weights(), trained):  # Refused before the checkpoint was restored into the model.
        np.testing.assert_array_equal(a, b)

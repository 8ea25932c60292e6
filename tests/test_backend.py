"""tfdist.distribute.backend: the step runner's thread, and how a multi-worker job's tasks leave.

`tfdist.fit` runs its executions on a `tfdist-steps` thread; each call must end
it on its way out (a notebook calling fit again and again must not collect
threads), and a second fit on the same strategy must still work.
"""

import socket
import threading
import time

import keras
import numpy as np
import pytest

import tfdist
from tfdist.distribute import backend as backend_lib
from tfdist.mnist import data

DIGITS = data.load_dataset("mnist")
X = DIGITS.train_images[:512].astype("float32") / 255.0
Y = DIGITS.train_labels[:512]


def step_threads():
    return [t for t in threading.enumerate() if t.name == "tfdist-steps" and t.is_alive()]


def small_model():
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(10, kernel_initializer=keras.initializers.GlorotUniform(0))])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_runner_runs_in_order_and_close_ends_its_thread():
    runner = backend_lib.Runner()
    seen = []
    futures = [runner.submit(seen.append, i) for i in range(5)]
    assert [f.result(timeout=10) for f in futures] == [None] * 5 and seen == list(range(5))
    failing = runner.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=10)
    assert runner.alive
    assert runner.close(timeout_s=10) and not runner.alive
    with pytest.raises(RuntimeError, match="runner was shut down"):
        runner.submit(seen.append, 5)


class Boom(Exception):
    pass


class RaiseAtEpochEnd(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        raise Boom("from a callback")


def test_each_fit_ends_its_runner_thread_returned_or_raised():
    before = step_threads()
    strategy = tfdist.make_strategy("default", precision="float32")
    with strategy.scope():
        model = small_model()
    first = tfdist.fit(model, X, Y, batch_size=64, epochs=1, verbose=0, strategy=strategy)
    assert step_threads() == before
    second = tfdist.fit(model, X, Y, batch_size=64, epochs=1, verbose=0, strategy=strategy)  # Same strategy again.
    assert step_threads() == before
    assert len(first.history["loss"]) == len(second.history["loss"]) == 1
    assert second.history["loss"][0] < first.history["loss"][0]
    with pytest.raises(Boom):
        tfdist.fit(model, X, Y, batch_size=64, epochs=2, verbose=0, strategy=strategy,
                   callbacks=[RaiseAtEpochEnd()])
    assert step_threads() == before
    third = tfdist.fit(model, X, Y, batch_size=64, epochs=1, verbose=0, strategy=strategy)
    assert np.isfinite(third.history["loss"][0]) and step_threads() == before


def test_wait_until_closed_returns_once_nothing_listens():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    start = time.monotonic()
    assert backend_lib.wait_until_closed([address], timeout_s=0.5) == [address]
    assert 0.5 <= time.monotonic() - start < 5
    threading.Timer(0.5, server.close).start()
    start = time.monotonic()
    assert backend_lib.wait_until_closed([address], timeout_s=30) == []
    assert time.monotonic() - start < 5


def test_strategies_a_notebook_drops_take_their_backends_with_them():
    import gc
    import weakref

    from tfdist.distribute import strategies

    made = []
    for _ in range(3):  # Each a new strategy object (the default strategy is one global object).
        strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32")
        made.append(weakref.ref(strategies.backend_of(strategy)))
        del strategy
    gc.collect()
    alive = [ref() for ref in made if ref() is not None]
    assert alive == [strategies.current_backend()]  # Only the newest, which fit uses by default.

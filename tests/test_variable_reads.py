"""tfdist.distribute.variable_reads: int()/float()/numpy reads of distributed variables, as of plain ones."""

import keras
import numpy as np

import tfdist
from tfdist.distribute import variable_reads
from tfdist.distribute.backend import tf_variable

MIRRORED = {"all_reduce": "reduce_to_one"}  # In-process strategies: see test_fitting.py.


class ReadsLearningRate(keras.callbacks.Callback):
    """What callbacks written for one device do: read the optimizer's numbers with float() and int()."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self.model.optimizer
        self.seen.append((int(optimizer.iterations), float(optimizer.learning_rate)))


def test_callbacks_and_code_after_fit_read_distributed_variables_as_on_one_device():
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32", **MIRRORED)
    assert variable_reads.install() == []  # make_strategy installed them; installing again adds nothing.
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5)
        model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse", metrics=["mae"])
    assert type(tf_variable(model.optimizer.iterations)).__name__ == "MirroredVariable"
    reads = ReadsLearningRate()
    x, y = np.ones((16, 3), "float32"), np.ones((16, 2), "float32")
    tfdist.fit(model, x, y, batch_size=8, epochs=2, verbose=0, callbacks=[reads])
    assert [s[0] for s in reads.seen] == [2, 4]
    np.testing.assert_allclose([s[1] for s in reads.seen], [0.05, 0.025])  # The schedule at those steps.
    assert int(model.optimizer.iterations) == 4 and float(model.optimizer.iterations) == 4.0
    total = model.metrics[0].variables[0]  # The loss tracker's sum: sync-on-read, read as its aggregate.
    assert type(tf_variable(total)).__name__ == "SyncOnReadVariable"
    copies = [float(np.asarray(copy)) for copy in tf_variable(total).values]  # Each replica's share.
    assert len(copies) == 2 and float(total) == sum(copies) > 0
    np.testing.assert_allclose(np.asarray(tf_variable(model.layers[0].kernel), dtype="float64"),
                               model.layers[0].get_weights()[0])

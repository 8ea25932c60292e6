"""Run by tests/test_custom_steps.py under tfdist-launch (2 workers) or horovodrun (2 ranks).

Usage: custom_steps.py STRATEGY OUT_DIR. Trains tests/custom_models.py's CustomFit (its own loss,
SGD) and the GAN (two optimizers) with tfdist.fit on datasets of global batches, from initial
weights it also saves; then (synchronous strategies) calls tfdist.train_on_batch twice on
custom_models.on_batch_model (7 rows, then 10 with sample_weight). Writes OUT_DIR/task<I>.npz: initial and
final weights, the History, and the train_on_batch model's initial and final weights and returned logs.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import tfdist  # noqa: E402
from tests import custom_models  # noqa: E402


def main() -> None:
    strategy_name, out = sys.argv[1], sys.argv[2]
    strategy = tfdist.make_strategy(strategy_name)
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = custom_models.custom_fit_model()
        gan = custom_models.gan_model()
    initial = model.get_weights()
    x, y = custom_models.regression()
    if strategy_name == "parameter_server":  # Arrays: a dataset object cannot be sent to the workers.
        train, images, options = (x, y), (custom_models.images(),), {"batch_size": 32}
    else:
        train = (tf.data.Dataset.from_tensor_slices((x, y)).batch(32, drop_remainder=True),)
        images, options = (tf.data.Dataset.from_tensor_slices(custom_models.images()).batch(32, drop_remainder=True),), {}
    history = tfdist.fit(model, *train, epochs=2, validation_data=(x[:100], y[:100]), verbose=0,
                         steps_per_execution=3, **options)
    gan_history = tfdist.fit(gan, *images, epochs=1, verbose=0, **options)
    on_batch = {}
    if strategy_name != "parameter_server":  # Refused there (tests/test_adopting.py).
        with strategy.scope():
            classifier = custom_models.on_batch_model()
        on_batch = {f"oi{i}": w for i, w in enumerate(classifier.get_weights())}
        names, first, second = custom_models.train_on_batch_calls(tfdist.train_on_batch, classifier)
        on_batch.update({f"o{i}": w for i, w in enumerate(classifier.get_weights())}, on_batch_names=names,
                        on_batch_first=np.asarray(first), on_batch_second=np.asarray(second))
    task = os.environ.get("HOROVOD_RANK") or json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get(
        "index", 0)
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, f"task{task}.npz"), history=json.dumps(history.history),
             gan_history=json.dumps(gan_history.history),
             gan_steps=np.array([int(gan.d_optimizer.iterations.numpy()), int(gan.g_optimizer.iterations.numpy())]),
             **{f"i{i}": w for i, w in enumerate(initial)}, **{f"w{i}": w for i, w in enumerate(model.get_weights())},
             **{f"g{i}": w for i, w in enumerate(gan.get_weights())}, **on_batch)
    print("done", task, flush=True)


if __name__ == "__main__":
    main()

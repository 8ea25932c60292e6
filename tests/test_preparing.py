"""tfdist.training.preparing: Keras' own error, raised while tfdist builds the model before any step, reaches the
UserError whole (one paragraph), so the part naming the bad key, often at its end, is kept."""

import keras
import numpy as np
import pytest

import tfdist
from tfdist.errors import MESSAGE_LIMIT, error_text

NAMES = [f"output_number_{i}_with_a_rather_long_descriptive_name" for i in range(6)]


def many_outputs(metrics):
    features = keras.Input((3,), name="features")
    model = keras.Model(features, {name: keras.layers.Dense(1, name=name)(features) for name in NAMES})
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=metrics)
    return model


def test_a_long_keras_error_naming_a_bad_key_at_its_end_reaches_the_user_error():
    """Keras' message for a metrics dict with a misspelled output key is about 2,400 characters and names the key
    after the 400th: today tfdist cuts it at 400 and the key is lost."""
    metrics = {name: ["mae"] for name in NAMES[:-1]}
    metrics["misspelled_output_key"] = ["mae"]
    x = np.ones((8, 3), "float32")
    y = {name: np.ones((8, 1), "float32") for name in NAMES}
    with pytest.raises(ValueError) as keras_error:
        many_outputs(metrics).fit(x, y, verbose=0)
    keras_message = " ".join(str(keras_error.value).split())
    assert len(keras_message) > 1000 and keras_message.index("extra key(s): ['misspelled_output_key']") > 400
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32")
    with strategy.scope():
        model = many_outputs(metrics)
    with pytest.raises(tfdist.UserError) as error:
        tfdist.fit(model, x, y, batch_size=4, verbose=0, strategy=strategy)
    message = str(error.value)
    assert "\n" not in message  # One paragraph.
    assert keras_message in message  # Whole, the bad key included.
    assert "extra key(s): ['misspelled_output_key']" in message


def test_only_a_pathological_message_is_cut_and_keeps_its_end():
    assert error_text(ValueError("a  b\n c")) == "a b c"
    long = ValueError("start " + "x" * (3 * MESSAGE_LIMIT) + " the bad key 'zzz'")
    text = error_text(long)
    assert len(text) < MESSAGE_LIMIT + 100
    assert text.startswith("start ") and text.endswith("the bad key 'zzz'") and "characters ...]" in text

"""A Keras user's model.fit script, moved to tfdist with a three-line change (README shows the diff).

  python examples/from_model_fit.py
  tfdist-launch --num_workers=2 -- python examples/from_model_fit.py

Before: `model = ...` at top level and `model.fit(x, y, batch_size=64, ...)`.
After: the model is built under `tfdist.make_strategy().scope()` and trained
with `tfdist.fit(model, x, y, ...)`; everything else is the user's own code.
"""

import os
import sys

import keras
import numpy as np

import tfdist  # changed: import tfdist
from tfdist.mnist import data

digits = data.load_dataset("mnist")
x_train = digits.train_images.astype("float32") / 255.0
x_test = digits.eval_images.astype("float32") / 255.0
y_train, y_test = digits.train_labels, digits.eval_labels
epochs = int(os.environ.get("EPOCHS", "3"))

strategy = tfdist.make_strategy()  # changed: pick the strategy from the environment
with strategy.scope():  # changed: build under its scope
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])

history = tfdist.fit(model, x_train, y_train, batch_size=64, epochs=epochs,  # changed: tfdist.fit(model, ...)
                     validation_data=(x_test, y_test), callbacks=[keras.callbacks.TerminateOnNaN()])
print(f"val_accuracy={history.history['val_accuracy'][-1]:.4f} "
      f"weights={abs(float(sum(np.sum(w) for w in model.get_weights()))):.6f}", flush=True)
sys.exit(0 if history.history["val_accuracy"][-1] >= 0.9 else 1)

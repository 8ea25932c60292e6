"""A multi-input (dict) Keras 3 model trained with tfdist.fit on the bundled digits.

  python examples/dict_inputs.py                                   # one device
  python examples/dict_inputs.py --strategy=mirrored --num_cpu_replicas=2
  tfdist-launch --num_workers=2 -- python examples/dict_inputs.py
  tfdist-launch --num_workers=2 --num_ps=1 -- python examples/dict_inputs.py
  horovodrun -np 2 -H localhost:2 --gloo python examples/dict_inputs.py

Inputs: the image, and each row's ink level as a token for an Embedding. The
model has BatchNormalization, Dropout and an L2 regulariser.
"""

import argparse
import hashlib

import keras
import numpy as np

import tfdist
from tfdist.mnist import data


def features(images: np.ndarray) -> dict:
    rows = (images.reshape(len(images), 28, 28).mean(axis=2) / 16).astype("int32")  # 28 tokens in 0..15
    return {"image": images, "rows": rows}


def build_model(seed: int = 0) -> keras.Model:
    image = keras.Input((28, 28, 1), dtype="uint8", name="image")
    rows = keras.Input((28,), dtype="int32", name="rows")
    x = keras.layers.Rescaling(1 / 255)(image)
    x = keras.layers.Conv2D(16, 3, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(seed))(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.BatchNormalization()(keras.layers.Flatten()(x))
    r = keras.layers.Flatten()(keras.layers.Embedding(16, 4, embeddings_initializer=keras.initializers.RandomNormal(
        seed=seed))(rows))
    x = keras.layers.Concatenate()([x, r])
    x = keras.layers.Dropout(0.2, seed=seed)(x)
    out = keras.layers.Dense(10, activation="softmax", dtype="float32",
                             kernel_regularizer=keras.regularizers.L2(1e-4),
                             kernel_initializer=keras.initializers.GlorotUniform(seed + 1))(x)
    return keras.Model({"image": image, "rows": rows}, out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--num_cpu_replicas", type=int)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workdir")
    parser.add_argument("--patience", type=int, help="EarlyStopping: stop after N epochs without a gain of 1.0 "
                        "(so after N+1 epochs: a fixed point for tests)")
    args = parser.parse_args()
    options = {"num_cpu_replicas": args.num_cpu_replicas} if args.num_cpu_replicas else {}
    strategy = tfdist.make_strategy(args.strategy, **options)
    digits = data.load_dataset("mnist")
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.Adam(2e-3), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    callbacks = [keras.callbacks.EarlyStopping("val_accuracy", patience=args.patience, min_delta=1.0)] \
        if args.patience else []
    history = tfdist.fit(model, features(digits.train_images), digits.train_labels, batch_size=64,
                         epochs=args.epochs, validation_data=(features(digits.eval_images), digits.eval_labels),
                         callbacks=callbacks, workdir=args.workdir)
    weights = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights())).hexdigest()[:16]
    print(f"epochs_run={len(history.history['loss'])} val_accuracy={history.history['val_accuracy'][-1]:.4f} "
          f"keys={','.join(sorted(history.history))} weights={weights}", flush=True)


if __name__ == "__main__":
    main()

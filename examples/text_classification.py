"""Text classification from raw strings with TextVectorization and masking (keras.io "from scratch"), on tfdist.

  python examples/text_classification.py                                   # one device
  python examples/text_classification.py --strategy=mirrored --num_cpu_replicas=2
  tfdist-launch --num_workers=2 -- python examples/text_classification.py

As keras.io does it: raw text in a `tf.data.Dataset` batched by 32, a
`TextVectorization` layer adapted on the training text and mapped over the
datasets, then a model on the token ids. Here the Embedding has
`mask_zero=True`, so the padding of short reviews is masked out of the
`GlobalAveragePooling1D` that follows. The reviews are made up (seeded, no
download): sentences from a small vocabulary, positive when they hold more
praise than complaint words. The change from `model.fit(train_ds, ...)` is to
build under `tfdist.make_strategy(...).scope()` and call `tfdist.fit(model, train_ds, ...)`.
"""

import argparse
import hashlib

import keras
import numpy as np
import tensorflow as tf
from keras import layers

import tfdist

MAX_FEATURES = 200
SEQUENCE_LENGTH = 24
EMBEDDING_DIM = 16
BATCH_SIZE = 32

PRAISE = ["great", "wonderful", "superb", "moving", "brilliant", "charming", "fun", "clever"]
COMPLAINT = ["awful", "boring", "dull", "terrible", "clumsy", "tedious", "bland", "weak"]
FILLER = ("the film movie plot actors story was is a an and but very quite rather with its this that of to in "
          "scene ending music cast director script it i thought felt").split()


def make_reviews(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` reviews of 4 to 24 words and their labels (1: more praise than complaint words; no ties)."""
    rng = np.random.default_rng(seed)
    texts, labels = [], []
    while len(texts) < n:
        length = int(rng.integers(4, SEQUENCE_LENGTH + 1))
        words = list(rng.choice(FILLER, size=length))
        good, bad = rng.integers(0, 4, size=2)
        if good == bad:
            continue
        for word_list, count in ((PRAISE, good), (COMPLAINT, bad)):
            for word in rng.choice(word_list, size=count):
                words[int(rng.integers(0, length))] = word
        texts.append(" ".join(words).capitalize() + ".")
        labels.append(int(sum(w in PRAISE for w in words) > sum(w in COMPLAINT for w in words)))
    return np.array(texts), np.array(labels, dtype="int32")


def raw_datasets() -> tuple[tf.data.Dataset, tf.data.Dataset]:
    x_train, y_train = make_reviews(1620, seed=1)
    x_val, y_val = make_reviews(410, seed=2)
    raw_train_ds = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(2000, seed=0).batch(BATCH_SIZE)
    raw_val_ds = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(BATCH_SIZE)
    return raw_train_ds, raw_val_ds


def vectorized_datasets() -> tuple[tf.data.Dataset, tf.data.Dataset]:
    """The datasets of token ids, with the vectorizer adapted on the training text alone."""
    raw_train_ds, raw_val_ds = raw_datasets()
    vectorize_layer = layers.TextVectorization(max_tokens=MAX_FEATURES, output_mode="int",
                                               output_sequence_length=SEQUENCE_LENGTH)
    vectorize_layer.adapt(raw_train_ds.map(lambda x, y: x))

    def vectorize_text(text, label):
        return vectorize_layer(tf.expand_dims(text, -1)), label

    train_ds = raw_train_ds.map(vectorize_text).cache().prefetch(buffer_size=10)
    val_ds = raw_val_ds.map(vectorize_text).cache().prefetch(buffer_size=10)
    return train_ds, val_ds


def build_model() -> keras.Model:
    inputs = keras.Input(shape=(None,), dtype="int64")
    x = layers.Embedding(MAX_FEATURES, EMBEDDING_DIM, mask_zero=True)(inputs)
    x = layers.Dropout(0.2)(x)
    x = layers.GlobalAveragePooling1D()(x)  # Averages over the words only: the padding is masked.
    x = layers.Dense(16, activation="relu")(x)
    predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)
    model = keras.Model(inputs, predictions)
    model.compile(loss="binary_crossentropy", optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"])
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--num_cpu_replicas", type=int)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    options = {"num_cpu_replicas": args.num_cpu_replicas} if args.num_cpu_replicas else {}
    strategy = tfdist.make_strategy(args.strategy, **options)  # changed: a strategy (before TF starts), its scope
    keras.utils.set_random_seed(0)
    train_ds, val_ds = vectorized_datasets()
    with strategy.scope():
        model = build_model()
    history = tfdist.fit(model, train_ds, validation_data=val_ds, epochs=args.epochs, verbose=0)  # changed
    weights = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights())).hexdigest()[:16]
    print(f"summary epochs_run={len(history.history['loss'])} loss={history.history['loss'][-1]:.4f} "
          f"val_accuracy={history.history['val_accuracy'][-1]:.4f} weights={weights}", flush=True)


if __name__ == "__main__":
    main()

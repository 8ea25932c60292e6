"""A transformer block classifier (keras.io "Text classification with Transformer"), on tfdist.

  python examples/transformer.py                                   # one device
  python examples/transformer.py --strategy=mirrored --num_cpu_replicas=2
  tfdist-launch --num_workers=2 -- python examples/transformer.py

keras.io's two custom layers: `TokenAndPositionEmbedding` (token plus
position embeddings) and `TransformerBlock` (MultiHeadAttention, a
feed-forward network, residuals, LayerNormalization and Dropout), pooled and
classified. The sequences are made up (seeded, no download): token ids where
the label is whether "signal" token 1 occurs more often than token 2. The
change from `model.fit(x, y, ...)` is to build under
`tfdist.make_strategy(...).scope()` and call `tfdist.fit(model, x, y, ...)`.
"""

import argparse
import hashlib

import keras
import numpy as np
from keras import layers, ops

import tfdist

VOCAB_SIZE = 1000
MAXLEN = 32
EMBED_DIM = 32  # Embedding size for each token
NUM_HEADS = 2  # Number of attention heads
FF_DIM = 32  # Hidden layer size in feed forward network inside transformer
BATCH_SIZE = 32


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


def make_sequences(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` sequences of MAXLEN token ids in 3..VOCAB_SIZE-1 with some 1s and 2s; label: more 1s than 2s."""
    rng = np.random.default_rng(seed)
    x = rng.integers(3, VOCAB_SIZE, size=(n, MAXLEN))
    ones, twos = rng.integers(0, 4, size=n), rng.integers(0, 4, size=n)
    twos = np.where(ones == twos, (twos + 1) % 4, twos)  # No ties.
    for i in range(n):
        places = rng.permutation(MAXLEN)[:ones[i] + twos[i]]
        x[i, places[:ones[i]]], x[i, places[ones[i]:]] = 1, 2
    return x.astype("int32"), (ones > twos).astype("int32")


def build_model() -> keras.Model:
    inputs = layers.Input(shape=(MAXLEN,))
    x = TokenAndPositionEmbedding(MAXLEN, VOCAB_SIZE, EMBED_DIM)(inputs)
    x = TransformerBlock(EMBED_DIM, NUM_HEADS, FF_DIM)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(0.1)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--num_cpu_replicas", type=int)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    options = {"num_cpu_replicas": args.num_cpu_replicas} if args.num_cpu_replicas else {}
    strategy = tfdist.make_strategy(args.strategy, **options)  # changed: a strategy (before TF starts), its scope
    keras.utils.set_random_seed(0)
    x_train, y_train = make_sequences(2000, seed=1)
    x_val, y_val = make_sequences(500, seed=2)
    with strategy.scope():
        model = build_model()
    history = tfdist.fit(model, x_train, y_train, batch_size=BATCH_SIZE, epochs=args.epochs,  # changed: tfdist.fit
                         verbose=0, validation_data=(x_val, y_val))
    weights = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights())).hexdigest()[:16]
    print(f"summary epochs_run={len(history.history['loss'])} loss={history.history['loss'][-1]:.4f} "
          f"val_accuracy={history.history['val_accuracy'][-1]:.4f} weights={weights}", flush=True)


if __name__ == "__main__":
    main()

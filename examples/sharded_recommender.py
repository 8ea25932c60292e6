"""A dot-product recommender whose user and item tables are `tfdist.layers.ShardedEmbedding`s.

  python examples/sharded_recommender.py                           # one device
  tfdist-launch --num_workers=2 --num_ps=2 -- python examples/sharded_recommender.py --strategy=parameter_server

20,000 users and 50,000 items, an 8-dimensional vector and a bias for each
(630,000 parameters in four tables). The clicks are made up (seeded, no
download): each user and item has hidden rank-4 factors and a bias, a user
clicks an item with probability sigmoid(factors . factors + biases), and a few
thousand active users and popular items get most of the 300,000 impressions.
The model is the usual dot product of a user tower and an item tower, trained
with Adagrad on binary cross-entropy for 4 epochs and judged by AUC on a
held-out 10% of the impressions (about 0.74 here; the clicks' own
probabilities score 0.87).

The changes from plain Keras: `keras.layers.Embedding` becomes
`tfdist.layers.ShardedEmbedding` (under parameter servers each table is split
into one row shard per ps task, and a step reads and updates only the rows its
batch looks up; Adagrad's update is exact), the model is built under
`tfdist.make_strategy(...).scope()`, and `model.fit` / `model.evaluate` become
`tfdist.fit(model, ...)` / `tfdist.evaluate(model, ...)`. On a parameter-server
job's worker and ps tasks `make_strategy` serves until the chief has finished,
so the same script runs on every task. The last line is
``held-out auc=0.XXXX loss=0.XXXX``.
"""

import argparse

import keras
import numpy as np
from keras import layers, ops

import tfdist
from tfdist.layers import ShardedEmbedding

NUM_USERS = 20_000
NUM_ITEMS = 50_000
RANK = 4  # Of the hidden preferences.
EMBEDDING_SIZE = 8
NUM_CLICKS = 300_000
BATCH_SIZE = 512


def make_clicks(seed: int = 0) -> tuple[dict, np.ndarray, dict, np.ndarray]:
    """(x_train, y_train, x_test, y_test): {"user", "item"} ids and 0/1 clicks, a 90/10 split."""
    rng = np.random.default_rng(seed)
    user_factors = rng.normal(size=(NUM_USERS, RANK)) / RANK ** 0.25
    item_factors = rng.normal(size=(NUM_ITEMS, RANK)) / RANK ** 0.25
    user_bias = rng.normal(scale=0.5, size=NUM_USERS)
    item_bias = rng.normal(scale=1.0, size=NUM_ITEMS)
    # Heavy tails: most impressions go to a few thousand active users and popular items.
    user = rng.permutation(NUM_USERS)[(rng.pareto(1.2, NUM_CLICKS) * 300).astype("int64") % NUM_USERS]
    item = rng.permutation(NUM_ITEMS)[(rng.pareto(1.2, NUM_CLICKS) * 500).astype("int64") % NUM_ITEMS]
    logit = 2.0 * np.sum(user_factors[user] * item_factors[item], axis=1) + user_bias[user] + item_bias[item]
    clicked = (rng.random(NUM_CLICKS) < 1 / (1 + np.exp(-logit))).astype("float32")
    x = {"user": user.astype("int32"), "item": item.astype("int32")}
    cut = int(0.9 * NUM_CLICKS)
    return ({k: v[:cut] for k, v in x.items()}, clicked[:cut],
            {k: v[cut:] for k, v in x.items()}, clicked[cut:])


def build_model() -> keras.Model:
    user = keras.Input((), dtype="int32", name="user")
    item = keras.Input((), dtype="int32", name="item")
    init = keras.initializers.RandomNormal(stddev=0.1, seed=0)
    user_vector = ShardedEmbedding(NUM_USERS, EMBEDDING_SIZE, embeddings_initializer=init, name="user_table")(user)
    item_vector = ShardedEmbedding(NUM_ITEMS, EMBEDDING_SIZE, embeddings_initializer=init, name="item_table")(item)
    user_bias = ShardedEmbedding(NUM_USERS, 1, embeddings_initializer="zeros", name="user_bias")(user)
    item_bias = ShardedEmbedding(NUM_ITEMS, 1, embeddings_initializer="zeros", name="item_bias")(item)
    score = ops.sum(user_vector * item_vector, axis=1, keepdims=True) + user_bias + item_bias
    clicked = layers.Activation("sigmoid", name="clicked")(score)
    model = keras.Model({"user": user, "item": item}, clicked)
    # Adagrad: each step updates only the rows its batch looked up (exactly Keras' update). The loss is a
    # mean over 512 examples, so a row's gradient is small next to the accumulator's start (0.1): hence
    # the large learning rate (10 learns faster, but 2 asynchronous workers then end 1-2 points of AUC
    # below one process).
    model.compile(optimizer=keras.optimizers.Adagrad(learning_rate=5.0),
                  loss=keras.losses.BinaryCrossentropy(), metrics=[keras.metrics.AUC(name="auc")])
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    strategy = tfdist.make_strategy(args.strategy)  # changed: a strategy (before TF starts), its scope
    keras.utils.set_random_seed(0)
    x_train, y_train, x_test, y_test = make_clicks()
    with strategy.scope():
        model = build_model()
    tfdist.fit(model, x_train, y_train, batch_size=BATCH_SIZE, epochs=args.epochs, verbose=2)  # changed
    result = tfdist.evaluate(model, x_test, y_test, batch_size=BATCH_SIZE, return_dict=True, verbose=0)  # changed
    print(f"held-out auc={result['auc']:.4f} loss={result['loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()

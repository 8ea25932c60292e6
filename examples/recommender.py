"""Collaborative filtering with large Embeddings (keras.io "Collaborative Filtering for Movie Recommendations").

  python examples/recommender.py                                   # one device
  python examples/recommender.py --strategy=mirrored --num_cpu_replicas=2
  tfdist-launch --num_workers=2 -- python examples/recommender.py

keras.io's `RecommenderNet`: a user and a movie embedding (20,000 users and
5,000 movies, 32 dimensions: 800k parameters, sparse gradients) and a bias
each, their dot product through a sigmoid, trained on ratings scaled to 0..1
with binary cross-entropy. The ratings are made up (seeded, no download):
from hidden rank-4 user and movie factors, 1 to 5 stars with noise. The change
from `model.fit(x, y, ...)` is to build under `tfdist.make_strategy(...).scope()`
and call `tfdist.fit(model, x, y, ...)`.
"""

import argparse
import hashlib

import keras
import numpy as np
from keras import layers, ops

import tfdist

NUM_USERS = 20_000
NUM_MOVIES = 5_000
EMBEDDING_SIZE = 32
NUM_RATINGS = 10_000
BATCH_SIZE = 64


class RecommenderNet(keras.Model):
    def __init__(self, num_users, num_movies, embedding_size, **kwargs):
        super().__init__(**kwargs)
        self.user_embedding = layers.Embedding(num_users, embedding_size, embeddings_initializer="he_normal",
                                               embeddings_regularizer=keras.regularizers.l2(1e-6))
        self.user_bias = layers.Embedding(num_users, 1)
        self.movie_embedding = layers.Embedding(num_movies, embedding_size, embeddings_initializer="he_normal",
                                                embeddings_regularizer=keras.regularizers.l2(1e-6))
        self.movie_bias = layers.Embedding(num_movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        dot_user_movie = ops.sum(user_vector * movie_vector, axis=1, keepdims=True)
        x = dot_user_movie + user_bias + movie_bias  # Add all the components (including bias)
        return ops.sigmoid(x)  # The sigmoid activation forces the rating to between 0 and 1


def make_ratings(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_val, y_val): (user, movie) pairs and ratings in 0..1, 90/10 split."""
    rng = np.random.default_rng(seed)
    users = rng.normal(size=(NUM_USERS, 4))
    movies = rng.normal(size=(NUM_MOVIES, 4))
    # Popular movies and active users: most ratings come from a few thousand of each.
    user = (rng.pareto(1.0, NUM_RATINGS) * 30).astype("int64") % NUM_USERS
    movie = (rng.pareto(1.0, NUM_RATINGS) * 10).astype("int64") % NUM_MOVIES
    score = np.sum(users[user] * movies[movie], axis=1) + 0.5 * rng.normal(size=NUM_RATINGS)
    stars = np.clip(np.round(3 + score), 1, 5)
    x = np.stack([user, movie], axis=1)
    y = ((stars - 1) / 4).astype("float32")  # Normalise the targets between 0 and 1, as keras.io does.
    cut = int(0.9 * NUM_RATINGS)
    return x[:cut], y[:cut], x[cut:], y[cut:]


def build_model() -> keras.Model:
    model = RecommenderNet(NUM_USERS, NUM_MOVIES, EMBEDDING_SIZE)
    model.compile(loss=keras.losses.BinaryCrossentropy(), optimizer=keras.optimizers.Adam(learning_rate=0.001))
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--num_cpu_replicas", type=int)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    options = {"num_cpu_replicas": args.num_cpu_replicas} if args.num_cpu_replicas else {}
    strategy = tfdist.make_strategy(args.strategy, **options)  # changed: a strategy (before TF starts), its scope
    keras.utils.set_random_seed(0)
    x_train, y_train, x_val, y_val = make_ratings()
    with strategy.scope():
        model = build_model()
    history = tfdist.fit(model, x=x_train, y=y_train, batch_size=BATCH_SIZE, epochs=args.epochs,  # changed
                         verbose=0, validation_data=(x_val, y_val))
    weights = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights())).hexdigest()[:16]
    print(f"summary epochs_run={len(history.history['loss'])} loss={history.history['loss'][-1]:.4f} "
          f"val_loss={history.history['val_loss'][-1]:.4f} weights={weights}", flush=True)


if __name__ == "__main__":
    main()

"""Keras models with their own train_step/test_step, written as keras.io writes them.

Shared by tests/test_custom_steps.py (in-process) and tests/programs/custom_steps.py
(2 MultiWorkerMirrored workers, 2 Horovod ranks), which also calls tfdist.train_on_batch on a compiled
classifier (`on_batch_model`), as a GAN or custom-loop program calls it once a step.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops


class CustomFit(keras.Model):
    """keras.io "Customizing what happens in fit()": its own loss and trackers, one optimizer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = layers.Dense(8, activation="tanh")
        self.out = layers.Dense(1)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = keras.losses.mean_squared_error(y, y_pred)  # Its own loss: a mean over its batch.
            loss = ops.mean(loss)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.loss_tracker.update_state(ops.mean(keras.losses.mean_squared_error(y, y_pred)))
        self.mae_metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


class ComputeLossFit(keras.Model):
    """keras.io's second form: compile(loss=, metrics=), self.compute_loss and the compiled metrics."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def compute_loss_model():
    inputs = keras.Input((4,))
    outputs = layers.Dense(1)(layers.Dense(8, activation="tanh")(inputs))
    model = ComputeLossFit(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


def custom_fit_model():
    model = CustomFit()
    model(np.zeros((1, 4), "float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


class GAN(keras.Model):
    """keras.io's DCGAN, shrunk: two models, two optimizers, its own trackers and a SeedGenerator."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        batch_size = ops.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        combined_images = ops.concatenate([generated_images, real_images], axis=0)
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = ops.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


def gan_model():
    discriminator = keras.Sequential([keras.Input((16,)), layers.Dense(16, activation="relu"), layers.Dense(1)])
    generator = keras.Sequential([keras.Input((4,)), layers.Dense(16, activation="relu"), layers.Dense(16)])
    gan = GAN(discriminator, generator, latent_dim=4)
    gan.compile(d_optimizer=keras.optimizers.SGD(0.05), g_optimizer=keras.optimizers.Adam(1e-3),
                loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    return gan


def regression(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (np.tanh(x @ rng.normal(size=(4, 1))) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def images(n=256, seed=1):
    return np.random.default_rng(seed).normal(size=(n, 16)).astype("float32")


# tfdist.train_on_batch, called once a step as a GAN or custom-loop program calls it --------------------------
ON_BATCH_ROWS = (7, 10)  # 7 rows: 4 and 3 a task on 2 tasks.


def on_batch_model():
    """A compiled classifier (SGD, a metric and a weighted metric) for the programs' train_on_batch calls."""
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((5,)), layers.Dense(8, activation="tanh"), layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="wacc")])
    return model


def on_batch_batches(seed=2):
    """The global batches (x, y, sample_weight) of the train_on_batch calls, one for each of ON_BATCH_ROWS."""
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(rows, 5)).astype("float32"), rng.integers(0, 3, rows).astype("int32"),
             rng.uniform(0.2, 2.0, rows).astype("float32")) for rows in ON_BATCH_ROWS]


def train_on_batch_calls(train_on_batch, model):
    """The calls: the first plain, as a dict; the second with sample_weight, as a list. Returns
    (the dict's keys sorted, their values, the list)."""
    (xa, ya, _), (xb, yb, wb) = on_batch_batches()
    first = train_on_batch(model, xa, ya, return_dict=True)
    second = train_on_batch(model, xb, yb, sample_weight=wb)
    return sorted(first), [first[k] for k in sorted(first)], list(second)

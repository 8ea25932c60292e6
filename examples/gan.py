"""A GAN with its own train_step and two optimizers (keras.io "DCGAN overriding train_step"), on tfdist.

  python examples/gan.py                                   # one device
  python examples/gan.py --strategy=mirrored --num_cpu_replicas=2
  tfdist-launch --num_workers=2 -- python examples/gan.py

The model is Keras' own pattern: a `keras.Model` subclass holding a
discriminator and a generator, compiled with `d_optimizer`, `g_optimizer` and
`loss_fn`, whose `train_step` trains each in turn and returns a dict of its
own `Mean` trackers. The images are the bundled digits (no download), batched
as keras.io batches them. The change from `gan.fit(dataset, ...)` is to build
under `tfdist.make_strategy(...).scope()` and call `tfdist.fit(gan, dataset, ...)`.
"""

import argparse
import hashlib

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

import tfdist
from tfdist.mnist import data

LATENT_DIM = 32
BATCH_SIZE = 64
NUM_IMAGES = 600


class GAN(keras.Model):
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
        # Sample random points in the latent space and decode them to fake images.
        batch_size = ops.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)

        # Combine them with real images; label fakes 1 and reals 0, with a little noise on the labels.
        combined_images = ops.concatenate([generated_images, real_images], axis=0)
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(ops.shape(labels), seed=self.seed_generator)

        # Train the discriminator.
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

        # Train the generator (without updating the discriminator): all fakes labelled "real".
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


def build_gan() -> GAN:
    """The discriminator and generator (small convnets on 28x28 digits), compiled as keras.io compiles them."""
    discriminator = keras.Sequential([
        keras.Input((28, 28, 1)),
        layers.Conv2D(32, 3, strides=2, padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2D(64, 3, strides=2, padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Flatten(),
        layers.Dropout(0.2),
        layers.Dense(1, activation="sigmoid"),
    ], name="discriminator")
    generator = keras.Sequential([
        keras.Input((LATENT_DIM,)),
        layers.Dense(7 * 7 * 32),
        layers.Reshape((7, 7, 32)),
        layers.Conv2DTranspose(32, 4, strides=2, padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2DTranspose(16, 4, strides=2, padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2D(1, 5, padding="same", activation="sigmoid"),
    ], name="generator")
    gan = GAN(discriminator=discriminator, generator=generator, latent_dim=LATENT_DIM)
    gan.compile(d_optimizer=keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5),
                g_optimizer=keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5),
                loss_fn=keras.losses.BinaryCrossentropy())
    return gan


def load_images() -> np.ndarray:
    digits = data.load_dataset("mnist")
    return digits.train_images[:NUM_IMAGES].astype("float32") / 255.0


def make_dataset(images: np.ndarray) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(images).shuffle(buffer_size=1024, seed=0).batch(BATCH_SIZE)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--num_cpu_replicas", type=int)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    options = {"num_cpu_replicas": args.num_cpu_replicas} if args.num_cpu_replicas else {}
    strategy = tfdist.make_strategy(args.strategy, **options)  # changed: a strategy (before TF starts), its scope
    keras.utils.set_random_seed(0)
    with strategy.scope():
        gan = build_gan()
    history = tfdist.fit(gan, make_dataset(load_images()), epochs=args.epochs, verbose=0)  # changed: tfdist.fit
    weights = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in gan.get_weights())).hexdigest()[:16]
    print(f"summary epochs_run={len(history.history['d_loss'])} d_loss={history.history['d_loss'][-1]:.4f} "
          f"g_loss={history.history['g_loss'][-1]:.4f} weights={weights}", flush=True)


if __name__ == "__main__":
    main()

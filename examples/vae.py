"""A variational autoencoder with its own train_step and loss trackers (keras.io "Variational AutoEncoder").

  python examples/vae.py                                   # one device
  python examples/vae.py --strategy=mirrored --num_cpu_replicas=2
  tfdist-launch --num_workers=2 -- python examples/vae.py

keras.io's model: a convolutional encoder ending in a `Sampling` layer (the
reparameterisation trick, with a seeded `SeedGenerator`), a decoder, and a
`VAE(keras.Model)` whose `train_step` adds the reconstruction and KL losses and
reports them through three `Mean` trackers. The images are the bundled digits
(no download), passed as an array with no labels, as keras.io passes them. The
change from `vae.fit(...)` is to build under `tfdist.make_strategy(...).scope()`
and call `tfdist.fit(vae, ...)`.
"""

import argparse
import hashlib

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

import tfdist
from tfdist.mnist import data

LATENT_DIM = 2
BATCH_SIZE = 128
NUM_IMAGES = 2048


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(shape=ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def build_encoder() -> keras.Model:
    encoder_inputs = keras.Input(shape=(28, 28, 1))
    x = layers.Conv2D(16, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = layers.Conv2D(32, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Flatten()(x)
    x = layers.Dense(16, activation="relu")(x)
    z_mean = layers.Dense(LATENT_DIM, name="z_mean")(x)
    z_log_var = layers.Dense(LATENT_DIM, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    return keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")


def build_decoder() -> keras.Model:
    latent_inputs = keras.Input(shape=(LATENT_DIM,))
    x = layers.Dense(7 * 7 * 32, activation="relu")(latent_inputs)
    x = layers.Reshape((7, 7, 32))(x)
    x = layers.Conv2DTranspose(32, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Conv2DTranspose(16, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    return keras.Model(latent_inputs, decoder_outputs, name="decoder")


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(ops.sum(keras.losses.binary_crossentropy(data, reconstruction),
                                                   axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }


def build_vae() -> VAE:
    vae = VAE(build_encoder(), build_decoder())
    vae.compile(optimizer=keras.optimizers.Adam())
    return vae


def load_digits() -> np.ndarray:
    digits = data.load_dataset("mnist")
    return digits.train_images[:NUM_IMAGES].astype("float32") / 255.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--num_cpu_replicas", type=int)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    options = {"num_cpu_replicas": args.num_cpu_replicas} if args.num_cpu_replicas else {}
    strategy = tfdist.make_strategy(args.strategy, **options)  # changed: a strategy (before TF starts), its scope
    keras.utils.set_random_seed(0)
    mnist_digits = load_digits()
    with strategy.scope():
        vae = build_vae()
    history = tfdist.fit(vae, mnist_digits, epochs=args.epochs, batch_size=BATCH_SIZE, verbose=0)  # changed
    weights = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in vae.get_weights())).hexdigest()[:16]
    logs = {k: v[-1] for k, v in history.history.items()}
    print(f"summary epochs_run={len(history.history['loss'])} loss={logs['loss']:.4f} "
          f"reconstruction_loss={logs['reconstruction_loss']:.4f} kl_loss={logs['kl_loss']:.4f} "
          f"weights={weights}", flush=True)


if __name__ == "__main__":
    main()

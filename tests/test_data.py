"""tfdist.mnist.data: the data sources (bundled digits, IDX directories, tensorflow-datasets, synthetic)."""

import hashlib
import os

import numpy as np
import pytest
import tensorflow_datasets.testing as tfds_testing

from tests.idx_files import write_mnist_dir
from tfdist.mnist import data
from tfdist.errors import UserError


def image_keys(images):
    return [hashlib.sha1(np.asarray(im).tobytes()).hexdigest() for im in images]


def test_bundled_split_is_fixed_and_disjoint():
    d = data.load_dataset("mnist")
    assert (d.num_train, d.num_eval) == (8000, 2000)
    train, held = set(image_keys(d.train_images)), set(image_keys(d.eval_images))
    assert not train & held, "an eval digit is also in the training split"
    # Every fifth digit of the real MNIST test split (the bundled files; test_idx checks they are the
    # published ones) is held out, the others train, in order.
    real = data.idx.read_images_and_labels(os.path.join(data.BUNDLED_DIR, "t10k-images-idx3-ubyte.gz"),
                                           os.path.join(data.BUNDLED_DIR, "t10k-labels-idx1-ubyte.gz"))
    held_out = np.arange(10000) % 5 == 4
    np.testing.assert_array_equal(d.eval_images, real[0][held_out])
    np.testing.assert_array_equal(d.eval_labels, real[1][held_out])
    np.testing.assert_array_equal(d.train_images, real[0][~held_out])
    np.testing.assert_array_equal(d.train_labels, real[1][~held_out])


def test_idx_directory_source(tmp_path):
    d = data.load_dataset("mnist")
    directory = write_mnist_dir(str(tmp_path / "idx"), d.train_images[:300, ..., 0], d.train_labels[:300],
                                d.eval_images[:50, ..., 0], d.eval_labels[:50], compress=True)
    loaded = data.load_dataset(f"idx:{directory}")
    assert (loaded.num_train, loaded.num_eval) == (300, 50)
    np.testing.assert_array_equal(loaded.train_images, d.train_images[:300])


def test_idx_directory_missing_file(tmp_path):
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"")
    with pytest.raises(UserError, match="has no train-labels-idx1-ubyte"):
        data.load_dataset(f"idx:{tmp_path}")
    with pytest.raises(UserError, match="no such directory"):
        data.load_dataset(f"idx:{tmp_path}/absent")


def test_unknown_source_lists_valid_ones():
    with pytest.raises(UserError, match=r"use one of: mnist \(bundled digits\), synthetic, idx:DIR"):
        data.load_dataset("cifar")


def test_synthetic_source_shapes():
    d = data.load_dataset("synthetic")
    assert d.train_images.shape == (data.SYNTHETIC_TRAIN, 28, 28, 1) and d.eval_labels.max() <= 9


def test_tfds_source_with_mock_data():
    with tfds_testing.mock_data(num_examples=96):
        d = data.load_dataset("tfds:mnist")
    assert d.name == "tfds:mnist"
    assert d.train_images.shape == (96, 28, 28, 1) and d.train_images.dtype == np.uint8
    assert d.num_eval == 96 and set(np.unique(d.train_labels)) <= set(range(10))


def test_tfds_without_download_says_what_is_missing(tmp_path):
    with pytest.raises(UserError) as e:
        data.load_dataset("tfds:mnist", data_dir=str(tmp_path))
    assert f"no prepared copy in {tmp_path}" in str(e.value) and "--download is off" in str(e.value)


def test_tfds_non_mnist_shape_is_rejected():
    with tfds_testing.mock_data(num_examples=8):
        with pytest.raises(UserError, match=r"has images of shape \(32, 32, 3\)"):
            data.load_dataset("tfds:cifar10")

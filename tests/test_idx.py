"""tfdist.mnist.idx: reading real MNIST IDX files, and errors that name the bad file."""

import gzip
import hashlib
import os

import numpy as np
import pytest

from tests.idx_files import idx_bytes, write_idx
from tfdist.mnist import data, idx
from tfdist.errors import UserError


# SHA-256 of the published MNIST test split's uncompressed IDX files.
MNIST_T10K_SHA256 = {
    "t10k-images-idx3-ubyte.gz": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte.gz": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}


def test_bundled_files_are_the_published_mnist_test_split():
    for name, digest in MNIST_T10K_SHA256.items():
        with gzip.open(os.path.join(data.BUNDLED_DIR, name)) as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, name


def test_reads_the_real_mnist_test_split():
    images, labels = idx.read_images_and_labels(
        os.path.join(data.BUNDLED_DIR, "t10k-images-idx3-ubyte.gz"),
        os.path.join(data.BUNDLED_DIR, "t10k-labels-idx1-ubyte.gz"),
    )
    assert images.shape == (10000, 28, 28, 1) and images.dtype == np.uint8
    assert np.bincount(labels).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert labels[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]  # MNIST's first test digits.
    assert images.max() == 255 and images[:, 0, 0, 0].max() == 0  # 8-bit ink; the corners are blank.


def test_plain_and_gzip_read_the_same(tmp_path):
    array = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    plain = write_idx(str(tmp_path / "a"), array)
    packed = write_idx(str(tmp_path / "b"), array, compress=True)
    np.testing.assert_array_equal(idx.read_idx(plain), idx.read_idx(packed))


def _write_raw(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def test_truncated_file_is_named(tmp_path):
    path = _write_raw(tmp_path / "imgs", idx_bytes(np.zeros((3, 28, 28)))[:-100])
    with pytest.raises(UserError) as e:
        idx.read_idx(path)
    assert f"IDX file {path} declares shape (3, 28, 28)" in str(e.value) and "truncated" in str(e.value)


def test_corrupt_gzip_is_named(tmp_path):
    data = gzip.compress(idx_bytes(np.zeros((3, 28, 28))))
    path = _write_raw(tmp_path / "imgs.gz", data[: len(data) // 2])
    with pytest.raises(UserError, match=f"IDX file {path} looks gzip-compressed but cannot be decompressed"):
        idx.read_idx(path)


def test_not_an_idx_file(tmp_path):
    path = _write_raw(tmp_path / "notes.txt", b"hello world")
    with pytest.raises(UserError, match=f"IDX file {path} does not start with an IDX magic number"):
        idx.read_idx(path)


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        idx.read_idx(str(tmp_path / "nope"))


def test_mismatched_counts_name_both_files(tmp_path):
    images = write_idx(str(tmp_path / "i"), np.zeros((5, 28, 28)))
    labels = write_idx(str(tmp_path / "l"), np.zeros(4))
    with pytest.raises(UserError) as e:
        idx.read_images_and_labels(images, labels)
    assert f"{images} holds 5 images but {labels} holds 4 labels" in str(e.value)


def test_swapped_files_are_caught(tmp_path):
    images = write_idx(str(tmp_path / "i"), np.zeros((5, 28, 28)))
    labels = write_idx(str(tmp_path / "l"), np.zeros(5))
    with pytest.raises(UserError, match="Is this an images file"):
        idx.read_images_and_labels(labels, images)


def test_labels_out_of_range(tmp_path):
    images = write_idx(str(tmp_path / "i"), np.zeros((2, 28, 28)))
    labels = write_idx(str(tmp_path / "l"), np.array([1, 12]))
    with pytest.raises(UserError, match="holds label 12; MNIST labels are 0-9"):
        idx.read_images_and_labels(images, labels)

"""Writes MNIST-format IDX files for tests (plain or gzip), independent of tfdist.mnist.idx."""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np


def idx_bytes(array: np.ndarray) -> bytes:
    array = np.asarray(array, np.uint8)
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.tobytes()


def write_idx(path: str, array: np.ndarray, compress: bool = False) -> str:
    data = idx_bytes(array)
    if compress:
        path += ".gz"
        data = gzip.compress(data)
    with open(path, "wb") as f:
        f.write(data)
    return path


def write_mnist_dir(directory: str, train_images, train_labels, test_images, test_labels, compress=False) -> str:
    os.makedirs(directory, exist_ok=True)
    write_idx(os.path.join(directory, "train-images-idx3-ubyte"), train_images, compress)
    write_idx(os.path.join(directory, "train-labels-idx1-ubyte"), train_labels, compress)
    write_idx(os.path.join(directory, "t10k-images-idx3-ubyte"), test_images, compress)
    write_idx(os.path.join(directory, "t10k-labels-idx1-ubyte"), test_labels, compress)
    return directory

"""Reading MNIST-format IDX files (plain or gzip-compressed) with clear errors.

IDX is the format the MNIST digits are published in: a 4-byte magic number
(two zero bytes, a type code, the number of dimensions), one big-endian uint32
per dimension, then the raw data. Every failure here names the file and says
what was expected, so a corrupt download is easy to spot.
"""

from __future__ import annotations

import gzip
import io
import zlib

import numpy as np
import tensorflow as tf

from tfdist.errors import UserError

_UBYTE = 0x08
_GZIP_MAGIC = b"\x1f\x8b"


def read_idx(path: str) -> np.ndarray:
    """Returns the uint8 array stored in the IDX file at `path`.

    Accepts gzip-compressed and uncompressed files; reads through
    `tf.io.gfile`, so `gs://` paths work too.
    """
    try:
        with tf.io.gfile.GFile(path, "rb") as f:
            raw = f.read()
    except tf.errors.NotFoundError:
        raise UserError(f"IDX file {path} does not exist.") from None
    except tf.errors.OpError as e:
        raise UserError(f"IDX file {path} could not be read: {e.message}") from None
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.GzipFile(fileobj=io.BytesIO(raw)).read()
        except (OSError, EOFError, zlib.error) as e:
            raise UserError(
                f"IDX file {path} looks gzip-compressed but cannot be decompressed "
                f"({e}); the file is corrupt or truncated. Download it again."
            ) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise UserError(
            f"IDX file {path} does not start with an IDX magic number (expected bytes "
            f"00 00 08 0N, found {raw[:4].hex(' ') or 'an empty file'}); it is not an "
            "MNIST-format IDX file."
        )
    dtype_code, ndim = raw[2], raw[3]
    if dtype_code != _UBYTE:
        raise UserError(
            f"IDX file {path} stores type code 0x{dtype_code:02x}; tfdist reads "
            "unsigned-byte IDX files (type 0x08) as MNIST publishes them."
        )
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise UserError(f"IDX file {path} has a truncated header ({len(raw)} bytes).")
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(shape))
    if len(raw) != expected:
        raise UserError(
            f"IDX file {path} declares shape {shape}, which needs {expected} bytes, but "
            f"holds {len(raw)} bytes; the file is "
            f"{'truncated' if len(raw) < expected else 'longer than its header says'}."
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def read_images_and_labels(images_path: str, labels_path: str) -> tuple[np.ndarray, np.ndarray]:
    """Reads an (images, labels) IDX pair and checks that they belong together.

    Returns images as uint8 [N, 28, 28, 1] and labels as int32 [N].
    """
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.ndim != 3 or images.shape[1:] != (28, 28):
        raise UserError(
            f"IDX file {images_path} holds an array of shape {images.shape}; MNIST "
            "images are (N, 28, 28). Is this an images file (idx3)?"
        )
    if labels.ndim != 1:
        raise UserError(
            f"IDX file {labels_path} holds an array of shape {labels.shape}; MNIST "
            "labels are (N,). Is this a labels file (idx1)?"
        )
    if len(images) != len(labels):
        raise UserError(
            f"IDX files do not match: {images_path} holds {len(images)} images but "
            f"{labels_path} holds {len(labels)} labels."
        )
    if labels.size and labels.max() > 9:
        raise UserError(
            f"IDX file {labels_path} holds label {int(labels.max())}; MNIST labels are 0-9."
        )
    return images[..., np.newaxis], labels.astype(np.int32)

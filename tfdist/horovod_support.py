"""Optional Horovod: availability checks that never import it eagerly.

Horovod 0.28.1 (its last release) builds against TensorFlow <= 2.18 only, and
its Keras helpers assume Keras 2; tfdist uses only its core TensorFlow ops.
"""

from __future__ import annotations

import importlib.util
from typing import Any

INSTALL_HINT = (
    "Install it with TensorFlow 2.18 (horovod 0.28.1 does not build against TensorFlow >= 2.19): "
    "pip install 'tensorflow==2.18.1' && HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 "
    "HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 "
    "pip install --no-build-isolation 'tfdist[horovod]'"
)


def is_horovod_available() -> bool:
    return importlib.util.find_spec("horovod") is not None


def report() -> dict[str, Any]:
    """What tfdist-env prints about Horovod; never raises."""
    if not is_horovod_available():
        return {"status": "not installed", "hint": INSTALL_HINT}
    try:
        import horovod
        import horovod.tensorflow as hvd
    except Exception as e:  # A build for another TF version fails here.
        return {"status": "installed but not importable with this TensorFlow", "error": str(e).splitlines()[0]}
    return {
        "status": f"importable (horovod {getattr(horovod, '__version__', '?')})",
        "tensorflow_built": bool(hvd.tensorflow_built()) if hasattr(hvd, "tensorflow_built") else True,
        "gloo_built": bool(hvd.gloo_built()),
        "mpi_built": bool(hvd.mpi_built()),
        "nccl_built": bool(hvd.nccl_built()),
    }

"""int(), float() and numpy reads of a tf.distribute variable, as of a plain tf.Variable.

A Keras variable made under a MirroredStrategy, MultiWorkerMirroredStrategy or TPUStrategy scope holds a
`DistributedVariable`, which TensorFlow gives no `__int__`, `__float__` or `__complex__` (its plain and
parameter-server variables have them). So `int(model.optimizer.iterations)` or
`float(model.optimizer.learning_rate)`, which work on one device, raise TypeError under a strategy, in a
callback or after fit. `install()` adds the three, reading the variable's value as `read_value()` does in the
caller's context (a mirrored variable's primary copy, a sync-on-read variable's aggregate), and an `__array__`
that takes NumPy 2's `copy` argument. Only methods the class lacks are added; nothing TensorFlow defines changes.
Called by `tfdist.make_strategy`; it stays for the process (the methods only turn a TypeError into a read).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
from tensorflow.python.distribute import values


def _numpy(variable: Any) -> np.ndarray:
    return np.asarray(variable.read_value())


def _array(variable: Any, dtype: Optional[Any] = None, copy: Optional[bool] = None) -> np.ndarray:
    return np.asarray(_numpy(variable), dtype=dtype)


METHODS = {
    "__int__": lambda self: int(_numpy(self)),
    "__float__": lambda self: float(_numpy(self)),
    "__complex__": lambda self: complex(_numpy(self)),
    "__array__": _array,
}


def install() -> list[str]:
    """Adds the methods `values.DistributedVariable` lacks; returns their names (empty once installed)."""
    added = []
    for name, method in METHODS.items():
        if not hasattr(values.DistributedVariable, name):
            setattr(values.DistributedVariable, name, method)
            added.append(name)
    return added

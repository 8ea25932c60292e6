"""What the conformance run imports and collects: stand-ins for missing packages, compile-flag variants, test ids.

A Keras test file that imports a missing optional package (jax, torch, grain) or Keras' own conftest.py (not in
the wheel) at top level gets a stand-in module while it is imported; tests named after a missing optional
package, and the run_eagerly/jit_compile variants of a parameterized case, are deselected (plugin.py).
"""

from __future__ import annotations

import importlib.util
import os
import re
import types
from typing import Any, Optional

import pytest

from tests.keras_conformance.files import keras_dir

# Optional packages some Keras tests import or are parameterized over. A test file importing a missing one at top
# level gets a stand-in module while it is imported (calling into it fails); tests named after a missing one are
# deselected (they are skipped or fail in both modes).
OPTIONAL = ("jax", "torch", "grain", "scipy", "pandas", "orbax")


def missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"stand-in for {name}, which is not installed (keras_conformance plugin)")

    def absent(attribute: str) -> Any:
        raise AttributeError(f"{name} is not installed: {name}.{attribute} is a keras_conformance stand-in")
    module.__getattr__ = absent  # type: ignore[method-assign]
    return module


def keras_conftest() -> types.ModuleType:
    """What Keras' tests import from Keras' repository's conftest.py: `skip_if_backend`, as Keras defines it."""
    import keras

    module = stand_in("conftest")

    def skip_if_backend(given_backend: str, reason: str) -> Any:
        return pytest.mark.skipif(keras.backend.backend() == given_backend, reason=reason)
    module.skip_if_backend = skip_if_backend  # type: ignore[attr-defined]
    return module


def compile_flag_variant(nodeid: str, nodeids: set) -> Optional[str]:
    """The kept sibling of a `..._eager`/`..._jit` parameterization (run_eagerly / jit_compile in compile), if any.

    Keras' trainer tests run many cases three times: compiled with run_eagerly=True, plain, and jit_compile=True.
    Through tfdist the three are one case (tfdist compiles its own steps, without XLA on several replicas in one
    process), so each mode runs only the plain one (`_graph_fn` / `_non_jit`) and saves a third of its time.
    """
    match = re.match(r"^(.*)_(eager|jit)$", nodeid)
    if not match:
        return None
    for plain in ("graph_fn", "non_jit"):
        sibling = f"{match.group(1)}_{plain}"
        if sibling in nodeids:
            return sibling
    return None


def conformance_id(item: Any) -> str:
    """`keras/src/trainers/trainer_test.py::TestTrainer::test_fit_flow_...`, wherever Keras is installed."""
    path = os.path.relpath(str(item.path), os.path.dirname(keras_dir())).replace(os.sep, "/")
    return path + "::" + item.nodeid.split("::", 1)[1]


def read_ids(path: Optional[str]) -> Optional[set[str]]:
    """The test ids a file lists, one a line (the first word; `#` starts a comment)."""
    if not path:
        return None
    with open(path) as f:
        return {line.split("#", 1)[0].split()[0] for line in f if line.split("#", 1)[0].strip()}

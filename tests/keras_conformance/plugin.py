"""A pytest plugin that runs Keras' own fit/evaluate/predict tests, as they are or through tfdist.

  python -m pytest -p tests.keras_conformance.plugin -p no:cacheprovider -q \\
      --keras-conformance=tfdist --keras-conformance-results=/tmp/tfdist.json \\
      $(python -m tests.keras_conformance.plugin files)

The files (files.py): FILES (the trainer, callbacks and tf.data adapter tests) and the broad set (models, layers,
optimizers, metrics, losses, saving, distillation, the TensorFlow backend). `files core` prints FILES only.

Modes (--keras-conformance):
  baseline  plain Keras, no strategy; only counts the calls of those methods (ROUTED) each test makes.
  tfdist    two logical CPU devices are configured before TensorFlow initialises, a 2-replica MirroredStrategy
            is made with `tfdist.make_strategy("mirrored", num_cpu_replicas=2)`, and Keras' TensorFlow trainer's
            `fit`, `evaluate`, `predict`, `test_on_batch` and `predict_on_batch` (the methods every Keras model,
            and Keras' test models built on the bare trainer class, inherit), and `train_on_batch` where tfdist
            has it, call tfdist's functions of those names with the same arguments and return what they return.
            Every test runs inside the strategy's scope. Keras' `TestCase.setUp` (and any test) calls
            `keras.backend.clear_session()`, whose `tf.compat.v1.reset_default_graph()` drops TensorFlow's
            strategy stack with the graph: the plugin wraps that function so that the scope is left before the
            reset and entered again after it.
  strategy  a diagnosis, not compared by the test: as tfdist (the same strategy and scope), but Keras' own
            methods run. A test that fails here as through tfdist, outside any tfdist frame, fails because of
            the run's strategy, not tfdist: a **harness** known failure.

--keras-conformance-sample=PATH (CI): of a broad file, only the test ids PATH lists run (sample.txt: one test a
broad file that calls one of those methods); FILES always run whole. --keras-conformance-only=PATH runs only the
test ids PATH lists, in every file (a rerun of some failures).

The results file (JSON) holds, per test id (`keras/src/...py::Class::test`), the outcome, the calls the test
made (`keras`: Keras' own fit/evaluate/predict/test_on_batch/predict_on_batch, top-level only; `routed`: calls
handed to tfdist's functions of those names; `unrouted`: `train_on_batch` where tfdist lacks it, which stays
Keras'), and for a failure the exception and the innermost tfdist frame of its traceback.
`python -m tests.keras_conformance.plugin draft BASELINE TFDIST` prints the lines of a known-failures list for
the tests that pass in baseline but not through tfdist; `mechanisms [BASELINE] TFDIST` groups the failures by
their innermost tfdist frame (results.py).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import threading
import time
import types
from typing import Any, Optional

import pytest

from tests.keras_conformance import results
from tests.keras_conformance.collection import (OPTIONAL, compile_flag_variant, conformance_id, keras_conftest, missing,
                                                read_ids, stand_in)
from tests.keras_conformance.files import FILES, keras_test_files
from tests.keras_conformance.limits import ConformanceLimit, Watchdog

MODES = ("baseline", "tfdist", "strategy")  # tests/test_keras_conformance.py compares the first two.
NUM_REPLICAS = 2
ROUTED = ("fit", "evaluate", "predict", "test_on_batch", "predict_on_batch")
UNROUTED = ("train_on_batch",)  # Routed too where tfdist has a function of its name (routed_methods()).


# The state of one run ------------------------------------------------------------------------------------
class _Run:
    def __init__(self) -> None:
        self.mode: Optional[str] = None
        self.results_path: Optional[str] = None
        self.strategy: Any = None
        self.scope: Any = None  # The strategy scope this plugin entered, while in force.
        self.tests: dict[str, dict] = {}
        self.current: Optional[dict] = None
        self.deselected: dict[str, str] = {}
        self.started = time.time()
        self.local = threading.local()
        self.killed: Optional[str] = None


RUN = _Run()


def _record() -> dict:
    return {"outcome": None, "keras": {}, "routed": {}, "unrouted": {}, "scope_missing": 0, "scope_lost": 0,
            "duration": 0.0, "rss_growth_mb": 0}


def _count(kind: str, name: str) -> None:
    if RUN.current is not None:
        RUN.current[kind][name] = RUN.current[kind].get(name, 0) + 1


def _enter_scope() -> None:
    if RUN.scope is None and RUN.strategy is not None:
        scope = RUN.strategy.scope()
        scope.__enter__()
        RUN.scope = scope


def _exit_scope() -> None:
    scope, RUN.scope = RUN.scope, None
    if scope is None:
        return
    try:
        scope.__exit__(None, None, None)
    except (IndexError, RuntimeError, AssertionError):  # The stack went without us: a reset we did not see.
        if RUN.current is not None:
            RUN.current["scope_lost"] += 1


def _counting(kind: str, name: str, original: Any) -> Any:
    """Keras' own method, counted when not called from inside another counted method (fit calls evaluate)."""
    @functools.wraps(original)
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(RUN.local, "depth", 0)
        if depth == 0:
            _count(kind, name)
        RUN.local.depth = depth + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            RUN.local.depth = depth
    return counted


def _routing(name: str, original: Any) -> Any:
    """`model.<name>(...)` -> `tfdist.<name>(model, ...)`, the arguments the caller gave and no others."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def routed(self: Any, *args: Any, **kwargs: Any) -> Any:
        import tensorflow as tf
        import tfdist

        arguments = dict(signature.bind(self, *args, **kwargs).arguments)
        arguments.pop("self")
        arguments.update(arguments.pop("kwargs", {}))
        _count("routed", name)
        if tf.distribute.get_strategy() is not RUN.strategy and RUN.current is not None:
            RUN.current["scope_missing"] += 1
        return getattr(tfdist, name)(self, **arguments)
    routed.__tfdist_routed__ = True  # type: ignore[attr-defined]
    return routed


def routed_methods() -> tuple[str, ...]:
    """ROUTED, and each UNROUTED method tfdist has a function of (`tfdist.train_on_batch`, where it exists)."""
    import tfdist

    return ROUTED + tuple(name for name in UNROUTED if hasattr(tfdist, name))


def _patch_keras(mode: str) -> None:
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    routed = routed_methods()
    for name in ROUTED + UNROUTED:
        original = getattr(TensorFlowTrainer, name)
        if name not in routed:
            setattr(TensorFlowTrainer, name, _counting("unrouted", name, original))
            continue
        counted = _counting("keras", name, original)  # In tfdist mode only a bypass would reach it.
        setattr(TensorFlowTrainer, name, _routing(name, counted) if mode == "tfdist" else counted)


def _keep_strategy_over_resets() -> None:
    """clear_session() resets the default graph, and TensorFlow keeps the strategy stack on it.

    The hook is TensorFlow's default-graph stack's `reset` (what `tf.compat.v1.reset_default_graph` calls),
    patched on its class: `tf.compat.v1` itself is rebound when a module imports from `tensorflow.compat.v1`
    (Keras' tensorboard_test.py does), so a patch of `tf.compat.v1.reset_default_graph` would be lost.
    """
    from tensorflow.python.framework import ops

    stack_class = type(ops._default_graph_stack)
    reset = stack_class.reset

    @functools.wraps(reset)
    def reset_keeping_strategy(self: Any) -> None:
        active = RUN.scope is not None
        _exit_scope()
        reset(self)
        if active:
            _enter_scope()
    stack_class.reset = reset_keeping_strategy


def _growth(grown_mb: int) -> None:
    if RUN.current is not None and grown_mb > RUN.current["rss_growth_mb"]:
        RUN.current["rss_growth_mb"] = grown_mb


def _stuck(reason: str) -> None:
    if RUN.current is not None:
        RUN.current.update(outcome="failed", error=f"killed: {reason}, and the test did not stop")
    RUN.killed = reason
    _write_results()


WATCHDOG = Watchdog(_growth, _stuck)


# pytest hooks ---------------------------------------------------------------------------------------------
def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("keras_conformance")
    group.addoption("--keras-conformance", choices=MODES, default=None,
                    help="baseline: Keras as it is; tfdist: fit/evaluate/predict through tfdist on 2 CPU replicas; "
                         "strategy: Keras' own fit/evaluate/predict under the same strategy (a diagnosis)")
    group.addoption("--keras-conformance-only", default=None,
                    help="a file of test ids (keras/src/...::Class::test, one a line): run only those")
    group.addoption("--keras-conformance-sample", default=None,
                    help="a file of test ids: of a broad test file (not FILES), run only those")
    group.addoption("--keras-conformance-results", default=None, help="where to write the results (JSON)")


def pytest_configure(config: Any) -> None:
    RUN.mode = config.getoption("--keras-conformance")
    RUN.results_path = config.getoption("--keras-conformance-results")
    if RUN.mode is None:
        return
    RUN.started = time.time()
    # Keras' own conftest.py (not in the wheel) registers this marker; it skips only on numpy/openvino backends.
    config.addinivalue_line("markers", "requires_trainable_backend: Keras' marker (trainable backends only)")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    if keras.backend.backend() != "tensorflow":
        raise pytest.UsageError(f"the conformance run needs KERAS_BACKEND=tensorflow, not {keras.backend.backend()}")
    if RUN.mode in ("tfdist", "strategy"):
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_REPLICAS)
        import tfdist

        RUN.strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=NUM_REPLICAS)
        if RUN.strategy.num_replicas_in_sync != NUM_REPLICAS:
            raise pytest.UsageError(f"expected {NUM_REPLICAS} replicas, got {RUN.strategy.num_replicas_in_sync}")
        _keep_strategy_over_resets()
    _patch_keras(RUN.mode)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: Any) -> Any:
    """Test modules that import jax, torch, grain or Keras' conftest at top level get stand-ins, removed after."""
    if RUN.mode is None or not isinstance(collector, pytest.Module):
        return (yield)
    added = [name for name in ("jax", "torch", "grain") if name not in sys.modules and missing(name)]
    for name in added:
        sys.modules[name] = stand_in(name)
    if "conftest" not in sys.modules:  # Keras' own conftest.py, which its tests import, is not in the wheel.
        sys.modules["conftest"] = keras_conftest()
        added.append("conftest")
    try:
        return (yield)
    finally:
        for name in added:
            if isinstance(sys.modules.get(name), types.ModuleType) and "stand-in" in (sys.modules[name].__doc__ or ""):
                del sys.modules[name]


def pytest_collection_modifyitems(config: Any, items: list) -> None:
    if RUN.mode is None:
        return
    absent = [name for name in OPTIONAL if missing(name)]
    names = {item.nodeid for item in items}
    only = read_ids(config.getoption("--keras-conformance-only"))
    sample = read_ids(config.getoption("--keras-conformance-sample"))
    kept = []
    for item in items:
        needs = [name for name in absent if name in item.name.lower()]
        variant = compile_flag_variant(item.nodeid, names)
        test_id = conformance_id(item)
        if only is not None and test_id not in only:
            continue
        if sample is not None and test_id.split("::", 1)[0].split("/", 1)[1] not in FILES and test_id not in sample:
            continue
        if needs:
            RUN.deselected[conformance_id(item)] = f"needs {needs[0]} (not installed)"
        elif variant:
            RUN.deselected[conformance_id(item)] = (
                f"compile-flag variant of {variant.rsplit('::', 1)[-1]}: tfdist.fit/evaluate/predict ignore "
                "run_eagerly, and jit_compile on 2 replicas in one process")
        else:
            kept.append(item)
    if len(kept) != len(items):
        chosen = {id(item) for item in kept}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in chosen])
        items[:] = kept


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Any:
    if RUN.mode is None:
        return (yield)
    RUN.current = RUN.tests.setdefault(conformance_id(item), _record())
    try:
        return (yield)
    finally:
        _exit_scope()
        RUN.current = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: Any) -> Any:
    """The strategy's scope around the test (setUp, the test, tearDown and cleanups all run here)."""
    if RUN.mode is None:
        return (yield)
    # Keras' tests draw unseeded random data and weights; seeded alike before each, a test's outcome does not
    # depend on the run (test_TensorBoard_weight_images diverges for some initial weights, which Keras trains
    # on and tfdist refuses).
    import keras

    keras.utils.set_random_seed(1337)
    if RUN.strategy is not None:
        _enter_scope()
    WATCHDOG.start()
    try:
        return (yield)
    except ConformanceLimit as stopped:  # Raised wherever the signal landed: a frame pytest may fail to show.
        raise ConformanceLimit(str(stopped)) from None
    finally:
        WATCHDOG.stop()
        _exit_scope()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    report = yield
    if RUN.mode is None or RUN.current is None:
        return report
    record = RUN.current
    record["duration"] += report.duration
    if report.failed:
        record["outcome"] = "failed" if report.when == "call" else "error"
        if call.excinfo is not None and "error" not in record:
            value = call.excinfo.value
            message = " ".join(str(value).split())
            record["error"] = f"{type(value).__name__}: {message[:400]}"
            record.update(results.frames(call.excinfo))
    elif report.skipped and record["outcome"] is None:
        record["outcome"] = "skipped"
    elif report.when == "call" and report.passed and record["outcome"] is None:
        record["outcome"] = "passed"
    return report


def pytest_sessionfinish(session: Any, exitstatus: Any) -> None:
    _write_results()


def _write_results() -> None:
    if RUN.mode is None or RUN.results_path is None:
        return
    import keras
    import tensorflow as tf

    data = {
        "mode": RUN.mode,
        "keras_version": keras.__version__,
        "tensorflow_version": tf.__version__,
        "num_replicas": NUM_REPLICAS if RUN.mode == "tfdist" else 1,
        "wall_s": round(time.time() - RUN.started, 1),
        "deselected": RUN.deselected,
        "killed": RUN.killed,
        "tests": dict(RUN.tests),
    }
    partial = RUN.results_path + ".partial"
    with open(partial, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(partial, RUN.results_path)


def main(argv: list[str]) -> int:
    """`files [core]`: the test files the run uses (core: FILES only); anything else goes to results.main."""
    if argv[:1] == ["files"]:
        print("\n".join(keras_test_files(broad=argv[1:] != ["core"])))
        return 0
    return results.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A pytest plugin that runs Keras' own fit/evaluate/predict tests, as they are or through tfdist.

  python -m pytest -p tests.keras_conformance.plugin -p no:cacheprovider -q \\
      --keras-conformance=tfdist --keras-conformance-results=/tmp/tfdist.json \\
      $(python -m tests.keras_conformance.plugin files)

Modes (--keras-conformance):
  baseline  plain Keras, no strategy; only counts the calls of those methods (ROUTED) each test makes.
  tfdist    two logical CPU devices are configured before TensorFlow initialises, a 2-replica MirroredStrategy
            is made with `tfdist.make_strategy("mirrored", num_cpu_replicas=2)`, and Keras' TensorFlow trainer's
            `fit`, `evaluate`, `predict`, `test_on_batch` and `predict_on_batch` (the methods every Keras model,
            and Keras' test models built on the bare trainer class, inherit) call tfdist's functions of those names
            with the same arguments and return what they return. Every test runs inside the strategy's scope. Keras'
            `TestCase.setUp` (and any test) calls `keras.backend.clear_session()`, whose
            `tf.compat.v1.reset_default_graph()` drops TensorFlow's strategy stack with the graph: the plugin wraps
            that function so that the scope is left before the reset and entered again after it.

The results file (JSON) holds, per test id (`keras/src/...py::Class::test`), the outcome, the calls the test
made (`keras`: Keras' own fit/evaluate/predict/test_on_batch/predict_on_batch, top-level only; `routed`: calls
handed to tfdist's functions of those names; `unrouted`: `train_on_batch`, which stays Keras'), and for a failure
the exception and the innermost tfdist frame of its traceback.
`python -m tests.keras_conformance.plugin draft BASELINE TFDIST` prints the lines of a known-failures list for
the tests that pass in baseline but not through tfdist.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import os
import re
import signal
import sys
import threading
import time
import types
from typing import Any, Optional

import pytest

MODES = ("baseline", "tfdist")
NUM_REPLICAS = 2
ROUTED = ("fit", "evaluate", "predict", "test_on_batch", "predict_on_batch")
UNROUTED = ("train_on_batch",)

# The Keras test files the run uses, relative to the installed keras package's directory: those whose tests call
# fit, evaluate or predict (the trainer, and the callbacks fit drives), plus tf_dataset_adapter_test.py (its one
# fit test of a distributed tf.data input).
FILES = (
    "src/trainers/trainer_test.py",
    "src/callbacks/backup_and_restore_test.py",
    "src/callbacks/callback_test.py",
    "src/callbacks/csv_logger_test.py",
    "src/callbacks/early_stopping_test.py",
    "src/callbacks/lambda_callback_test.py",
    "src/callbacks/learning_rate_scheduler_test.py",
    "src/callbacks/model_checkpoint_test.py",
    "src/callbacks/monitor_callback_test.py",
    "src/callbacks/reduce_lr_on_plateau_test.py",
    "src/callbacks/swap_ema_weights_test.py",
    "src/callbacks/tensorboard_test.py",
    "src/callbacks/terminate_on_nan_test.py",
    "src/trainers/data_adapters/tf_dataset_adapter_test.py",
)
# Left out, and why (keras/src/... paths).
LEFT_OUT = {
    "src/callbacks/orbax_checkpoint_test.py": "needs orbax (a checkpoint service), not installed with tfdist",
    "src/callbacks/remote_monitor_test.py": "needs an HTTP monitoring server",
    "src/trainers/data_adapters/grain_dataset_adapter_test.py": "needs grain",
    "src/trainers/data_adapters/torch_data_loader_adapter_test.py": "needs torch",
    "src/trainers/epoch_iterator_test.py": "tests Keras' EpochIterator directly; no fit/evaluate/predict call",
    "src/trainers/data_adapters/array_data_adapter_test.py": "tests the adapter directly; no fit/evaluate/predict",
    "src/trainers/data_adapters/generator_data_adapter_test.py": "tests the adapter directly; no fit/evaluate/predict",
    "src/trainers/data_adapters/py_dataset_adapter_test.py": "tests the adapter directly; no fit/evaluate/predict",
    "src/trainers/data_adapters/data_adapter_utils_test.py": "tests helpers directly; no fit/evaluate/predict",
    "src/trainers/compile_utils_test.py": "tests compile's loss/metric containers; no fit/evaluate/predict",
}
# Optional packages some Keras tests import or are parameterized over. A test file importing a missing one at top
# level gets a stand-in module while it is imported (calling into it fails); tests named after a missing one are
# deselected (they are skipped or fail in both modes).
OPTIONAL = ("jax", "torch", "grain", "scipy", "pandas", "orbax")
# Each test's limits: past one, the test fails with ConformanceLimit (raised in the main thread by a signal); if
# the test does not end within GRACE_S after that, the run writes its results and exits (status EXIT_KILLED).
TEST_TIMEOUT_S = float(os.environ.get("KERAS_CONFORMANCE_TEST_TIMEOUT_S", "90"))  # 30 s seen on a busy CI
TEST_MEMORY_MB = float(os.environ.get("KERAS_CONFORMANCE_TEST_MEMORY_MB", "300"))  # Growth of the RSS in a test.
GRACE_S = 20.0
EXIT_KILLED = 70


def keras_dir() -> str:
    spec = importlib.util.find_spec("keras")
    if spec is None or not spec.origin:
        raise RuntimeError("keras is not installed")
    return os.path.dirname(spec.origin)


def keras_test_files() -> list[str]:
    return [os.path.join(keras_dir(), f) for f in FILES]


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


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
        if tf.distribute.get_strategy() is not RUN.strategy:
            _count_scope_missing()
        return getattr(tfdist, name)(self, **arguments)
    routed.__tfdist_routed__ = True  # type: ignore[attr-defined]
    return routed


def _count_scope_missing() -> None:
    if RUN.current is not None:
        RUN.current["scope_missing"] += 1


def _patch_keras(mode: str) -> None:
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    for name in ROUTED:
        original = getattr(TensorFlowTrainer, name)
        counted = _counting("keras", name, original)  # In tfdist mode only a bypass would reach it.
        setattr(TensorFlowTrainer, name, _routing(name, counted) if mode == "tfdist" else counted)
    for name in UNROUTED:
        setattr(TensorFlowTrainer, name, _counting("unrouted", name, getattr(TensorFlowTrainer, name)))


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


class ConformanceLimit(BaseException):
    """A test went past the run's time or memory limit (BaseException: no `except Exception` in the way)."""


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


class _Watchdog:
    """Stops a test that runs too long or grows the process too much (an infinite generator read into memory)."""

    def __init__(self) -> None:
        self.reason: Optional[str] = None
        self.done = threading.Event()
        self.thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self.reason, self.done = None, threading.Event()
        signal.signal(signal.SIGUSR1, self._raise)
        self.thread = threading.Thread(target=self._watch, args=(self.done, threading.main_thread().ident),
                                       daemon=True, name="keras_conformance_watchdog")
        self.thread.start()

    def stop(self) -> None:
        self.done.set()

    def _raise(self, signum: int, frame: Any) -> None:
        if self.reason is not None and not self.done.is_set():
            raise ConformanceLimit(self.reason)

    def _watch(self, done: threading.Event, main: int) -> None:
        start, rss0 = time.time(), _rss_mb()
        while not done.wait(0.5):
            grown = _rss_mb() - rss0
            record = RUN.current
            if record is not None and grown > record["rss_growth_mb"]:
                record["rss_growth_mb"] = int(grown)
            if time.time() - start > TEST_TIMEOUT_S:
                self.reason = f"keras_conformance: the test ran past {TEST_TIMEOUT_S:.0f} s"
            elif grown > TEST_MEMORY_MB:
                self.reason = (f"keras_conformance: the process grew by {grown:.0f} MB in the test "
                               f"(limit {TEST_MEMORY_MB:.0f})")
            else:
                continue
            signal.pthread_kill(main, signal.SIGUSR1)
            if done.wait(GRACE_S):
                return
            if RUN.current is not None:  # The main thread is stuck in TensorFlow: give up on the run.
                RUN.current.update(outcome="failed", error=f"killed: {self.reason}, and the test did not stop")
            RUN.killed = self.reason
            _write_results()
            os._exit(EXIT_KILLED)


WATCHDOG = _Watchdog()


# pytest hooks ---------------------------------------------------------------------------------------------
def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("keras_conformance")
    group.addoption("--keras-conformance", choices=MODES, default=None,
                    help="baseline: Keras as it is; tfdist: fit/evaluate/predict through tfdist on 2 CPU replicas")
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
    if RUN.mode == "tfdist":
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_REPLICAS)
        import tfdist

        RUN.strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=NUM_REPLICAS)
        if RUN.strategy.num_replicas_in_sync != NUM_REPLICAS:
            raise pytest.UsageError(f"expected {NUM_REPLICAS} replicas, got {RUN.strategy.num_replicas_in_sync}")
        _keep_strategy_over_resets()
    _patch_keras(RUN.mode)


def _stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"stand-in for {name}, which is not installed (keras_conformance plugin)")

    def missing(attribute: str) -> Any:
        raise AttributeError(f"{name} is not installed: {name}.{attribute} is a keras_conformance stand-in")
    module.__getattr__ = missing  # type: ignore[method-assign]
    return module


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: Any) -> Any:
    """Test modules that import jax or torch at top level import with stand-ins, removed right after."""
    if RUN.mode is None or not isinstance(collector, pytest.Module):
        return (yield)
    added = [name for name in ("jax", "torch") if name not in sys.modules and _missing(name)]
    for name in added:
        sys.modules[name] = _stand_in(name)
    try:
        return (yield)
    finally:
        for name in added:
            if isinstance(sys.modules.get(name), types.ModuleType) and "stand-in" in (sys.modules[name].__doc__ or ""):
                del sys.modules[name]


def conformance_id(item: Any) -> str:
    """`keras/src/trainers/trainer_test.py::TestTrainer::test_fit_flow_...`, wherever Keras is installed."""
    path = os.path.relpath(str(item.path), os.path.dirname(keras_dir())).replace(os.sep, "/")
    return path + "::" + item.nodeid.split("::", 1)[1]


def _compile_flag_variant(nodeid: str, nodeids: set) -> Optional[str]:
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


def pytest_collection_modifyitems(config: Any, items: list) -> None:
    if RUN.mode is None:
        return
    missing = [name for name in OPTIONAL if _missing(name)]
    names = {item.nodeid for item in items}
    kept = []
    for item in items:
        needs = [name for name in missing if name in item.name.lower()]
        variant = _compile_flag_variant(item.nodeid, names)
        if needs:
            RUN.deselected[conformance_id(item)] = f"needs {needs[0]} (not installed)"
        elif variant:
            RUN.deselected[conformance_id(item)] = (
                f"compile-flag variant of {variant.rsplit('::', 1)[-1]}: tfdist.fit/evaluate/predict ignore "
                "run_eagerly, and jit_compile on 2 replicas in one process")
        else:
            kept.append(item)
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
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
    if RUN.mode == "tfdist":
        _enter_scope()
    WATCHDOG.start()
    try:
        return (yield)
    finally:
        WATCHDOG.stop()
        _exit_scope()


def _where(excinfo: Any) -> dict[str, Optional[str]]:
    """The innermost tfdist frame, test-file frame and frame of a failure, as 'path:line in function'."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    site = os.path.dirname(keras_dir())
    found: dict[str, Optional[str]] = {"tfdist_frame": None, "test_frame": None, "raised_at": None}
    tb = excinfo.value.__traceback__ if excinfo is not None else None
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        shown = path
        for root in (site, repo):
            if path.startswith(root + os.sep):
                shown = os.path.relpath(path, root).replace(os.sep, "/")
                break
        text = f"{shown}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"
        found["raised_at"] = text
        if shown.startswith("tfdist/"):
            found["tfdist_frame"] = text
        if shown.startswith("keras/") and shown.endswith("_test.py"):
            found["test_frame"] = text
        tb = tb.tb_next
    return found


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
            record.update(_where(call.excinfo))
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


# Reading results and the known-failures list ---------------------------------------------------------------
KNOWN_LINE = re.compile(r"^(?P<id>\S+)\s+#\s*(?P<category>[^:]+?)\s*:\s*(?P<reason>\S.*)$")


def read_known_failures(path: str) -> tuple[dict[str, tuple[str, str]], Optional[str]]:
    """({test id: (category, reason)}, the Keras version the list was made with, from '# keras X.Y.Z')."""
    known: dict[str, tuple[str, str]] = {}
    version = None
    with open(path) as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                found = re.match(r"#\s*keras\s+(\S+)", line)
                if found and version is None:
                    version = found.group(1).rstrip(",")
                continue
            match = KNOWN_LINE.match(line)
            if not match:
                raise ValueError(f"{path}:{number}: expected '<test id>  # <category>: <reason>', got {line!r}")
            if match["id"] in known:
                raise ValueError(f"{path}:{number}: {match['id']} is listed twice")
            known[match["id"]] = (match["category"], match["reason"])
    return known, version


def passed(results: dict) -> set[str]:
    return {t for t, r in results["tests"].items() if r["outcome"] == "passed"}


def calls_fit(record: dict) -> bool:
    return sum(record["keras"].values()) > 0


def compare(baseline: dict, through: dict, known: dict[str, tuple[str, str]]) -> dict:
    """What the conformance test asserts on, as lists of test ids and counts."""
    base_pass, tfdist_pass = passed(baseline), passed(through)
    fit_tests = {t for t in base_pass if calls_fit(baseline["tests"][t])}
    return {
        "unexpected": sorted(base_pass - tfdist_pass - set(known)),  # Broken through tfdist, not listed.
        "now_passing": sorted(t for t in known if t in tfdist_pass),  # Listed, but passes: drop it from the list.
        "not_baseline": sorted(t for t in known if t not in base_pass),  # Listed, but no baseline pass (renamed?).
        "not_routed": sorted(t for t in fit_tests if t in through["tests"]
                             and not sum(through["tests"][t]["routed"].values())
                             and through["tests"][t]["outcome"] == "passed"),
        "keras_calls": sorted(t for t, r in through["tests"].items() if sum(r["keras"].values())),
        "scope_trouble": sorted(t for t, r in through["tests"].items() if r["scope_missing"] or r["scope_lost"]),
        "fit_tests": len(fit_tests),
        "fit_tests_passing": len(fit_tests & tfdist_pass),
        "baseline_passing": len(base_pass),
        "baseline_passing_through_tfdist": len(base_pass & tfdist_pass),
    }


def draft(baseline: dict, through: dict) -> list[str]:
    """Known-failure lines (category to fill in) for the baseline passes that fail through tfdist."""
    lines = []
    for test in sorted(passed(baseline) - passed(through)):
        record = through["tests"].get(test, {"outcome": "missing"})
        where = " ".join(record.get(k) or "" for k in ("tfdist_frame", "test_frame")).strip() or record.get("raised_at")
        lines.append(f"{test}  # ?: {record['outcome']} {record.get('error', '')[:200]} [{where}]")
    return lines


def main(argv: list[str]) -> int:
    if argv[:1] == ["files"]:
        print("\n".join(keras_test_files()))
        return 0
    if argv[:1] == ["draft"] and len(argv) == 3:
        loaded = []
        for path in argv[1:]:
            with open(path) as f:
                loaded.append(json.load(f))
        print("\n".join(draft(*loaded)))
        return 0
    print("usage: python -m tests.keras_conformance.plugin files | draft BASELINE.json TFDIST.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

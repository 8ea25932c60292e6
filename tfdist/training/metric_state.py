"""The flat totals vector a step adds to: examples, non-finite steps, stop requests and metric state."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist.distribute.backend import tf_variable


NUM_SCALARS = 3  # examples, non-finite losses, stop requests.


class MetricLayout:
    """Where each of the model's metric variables sits in the flat totals vector.

    ``[examples, non-finite steps, stop requests, metric state...]``, summed over
    replicas, steps and executions. A custom step (`tfdist.training.custom_steps`)
    adds ``logs``: a tail holding its last step's non-metric logs, replaced by
    each step instead of summed, and ``keys``: the log keys it returns, in order.
    """

    def __init__(self, model: keras.Model, *, keys: Optional[Sequence[str]] = None,
                 logs: Optional["LogLayout"] = None):
        self.metrics = list(model.metrics)
        self.variables = [v for m in self.metrics for v in m.variables]
        self.shapes = [tuple(v.shape) for v in self.variables]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.base = NUM_SCALARS + sum(self.sizes)
        self.keys = list(keys) if keys is not None else None
        self.logs = logs
        self.size = self.base + (logs.size if logs is not None else 0)

    def zeros(self) -> list[tf.Tensor]:
        return [tf.zeros(v.shape, v.dtype) for v in self.variables]

    def pack(self, scalars: Sequence[tf.Tensor], values: Sequence[tf.Tensor]) -> tf.Tensor:
        parts = [tf.cast(tf.reshape(s, [1]), tf.float32) for s in scalars]
        parts += [tf.reshape(tf.cast(v, tf.float32), [-1]) for v in values]
        return tf.concat(parts, 0)

    def add_step(self, totals: tf.Tensor, scalars: Sequence[tf.Tensor], values: Sequence[tf.Tensor],
                 tail: Optional[tf.Tensor] = None) -> tf.Tensor:
        """``totals`` with one step added (compiled); a custom step's ``tail`` replaces the last one."""
        summed = totals[:self.base] + self.pack(scalars, values)
        if self.logs is None:
            return summed
        return tf.concat([summed, tail if tail is not None else totals[self.base:]], 0)

    def opening(self) -> np.ndarray:
        """As Keras' reset_metrics at an epoch's or an evaluation's start: each metric's own reset_state(), then
        its state (zeros, unless its reset_state keeps it) as the totals the steps add to."""
        totals = np.zeros(self.size)
        for metric in self.metrics:
            metric.reset_state()
        offset = NUM_SCALARS
        for variable, size in zip(self.variables, self.sizes):
            totals[offset:offset + size] = np.reshape(tf_variable(variable).read_value(), [-1])
            offset += size
        return totals

    def store(self, totals: np.ndarray) -> None:
        """The summed states written into the metrics' variables, where Keras' fit leaves them (a metric read
        after fit, or by a callback at an epoch's end, shows what Keras' would)."""
        offset = NUM_SCALARS
        for variable, size, shape in zip(self.variables, self.sizes, self.shapes):
            value = np.asarray(totals[offset:offset + size]).reshape(shape).astype(variable.dtype)
            held = tf_variable(variable)
            copies = getattr(held, "values", None) \
                if getattr(held, "synchronization", None) == tf.VariableSynchronization.ON_READ else None
            if copies and len(copies) > 1:  # Sync-on-read (summed when read): the total on the first copy only.
                for index, copy in enumerate(copies):  # (Assigning the whole would split it, truncating ints.)
                    copy.assign(value if index == 0 else np.zeros_like(value))
            else:
                variable.assign(value)
            offset += size

    def combine(self, earlier: np.ndarray, later: np.ndarray) -> np.ndarray:
        """Two executions' totals (on the host): sums, and the later logs tail where it holds a step."""
        combined = np.asarray(earlier, np.float64) + np.asarray(later, np.float64)
        if self.logs is not None:
            tail = later[self.base:] if later[self.base] > 0 else earlier[self.base:]
            combined[self.base:] = tail
        return combined

    def results(self, totals: np.ndarray, prefix: str = "") -> dict[str, float]:
        """Keras' own names and values (`Model.get_metrics_result`) for summed states.

        For a custom step: its own keys, each a metric's result where it names one,
        else the last step's value.
        """
        values, offset = [], NUM_SCALARS
        for shape, size, variable in zip(self.shapes, self.sizes, self.variables):
            values.append(np.asarray(totals[offset:offset + size], variable.dtype).reshape(shape))
            offset += size
        logs: dict[str, float] = {}
        start = 0
        for metric in self.metrics:
            count = len(metric.variables)
            result = stateless_result(metric, values[start:start + count])
            start += count
            for name, value in _flat_items(result, metric.name):
                logs[name] = float(value) if value.ndim == 0 else value  # As Keras' pythonify_logs.
        if self.keys is not None:
            last = self.logs.results(np.asarray(totals[self.base:])) if self.logs is not None else {}
            logs = {key: logs[key] if key in logs else last[key] for key in self.keys}
        return {prefix + name: value for name, value in logs.items()}


def stateless_result(metric: keras.metrics.Metric, values: Sequence[np.ndarray]) -> Any:
    """``metric.stateless_result(values)`` as numpy arrays, read while the values stand for its variables.

    Keras' stateless_result returns what ``result()`` returns once its state mapping has ended, so a
    ``result()`` that returns a state variable itself (keras.io's ``CategoricalTruePositives``) would be read
    live: the variable's value, not the summed states, and under a multi-worker strategy a read of a
    sync-on-read variable is a collective only the task that reads it issues. Every leaf is read inside the
    mapping here, and a leaf that is one of the metric's own TensorFlow variables is its mapped value.
    """
    variables = list(metric.variables)
    own = {id(tf_variable(v)): value for v, value in zip(variables, values)}
    with keras.StatelessScope(state_mapping=list(zip(variables, values))):  # Keras' stateless_result, read inside.
        return keras.tree.map_structure(lambda leaf: _read(leaf, own), metric.result())


def _flat_items(result: Any, name: str) -> list[tuple[str, np.ndarray]]:
    """A metric's result as (name, value) pairs: a dict's items, nested dicts flattened (Keras' pythonify_logs)."""
    if not isinstance(result, dict):
        return [(name, result)]
    return [item for key, value in result.items() for item in _flat_items(value, str(key))]


def _read(leaf: Any, own: dict) -> np.ndarray:
    if isinstance(leaf, tf.Variable) and id(leaf) in own:  # A raw tf.Variable behind a metric variable.
        return np.asarray(own[id(leaf)])
    return np.asarray(leaf)  # A Keras variable reads its mapped value in the scope.


class LogLayout:
    """The tail of the totals vector that holds the last step's non-metric logs (weighted by examples).

    Slot 0 is the step's examples on this replica; slot 1+i is log i times them.
    Each step replaces the tail (Keras reports a custom step's last logs).
    """

    def __init__(self, keys: Sequence[str]):
        self.keys = list(keys)
        self.size = 1 + len(self.keys)

    def pack(self, examples: tf.Tensor, logs: dict) -> tf.Tensor:
        n = tf.cast(examples, tf.float32)
        logs = flatten_logs(logs)
        values = [tf.where(n > 0, tf.reshape(tf.cast(logs[k], tf.float32), []) * n, 0.0) for k in self.keys]
        return tf.stack([n] + values)

    def results(self, tail: np.ndarray) -> dict[str, float]:
        n = float(tail[0])
        return {k: (float(tail[1 + i]) / n if n else float("nan")) for i, k in enumerate(self.keys)}


def flatten_logs(logs: dict) -> dict:
    """Nested dicts of logs (``CompileMetrics.result()``) flattened into one, sorted, as Keras' fit does."""
    flat: dict = {}
    for key, value in sorted(logs.items()):
        if isinstance(value, dict):
            flat.update(flatten_logs(value))
        else:
            flat[str(key)] = value
    return flat

"""The one place tfdist's sharding uses TensorFlow's private names (tested by tests/test_zero_collectives.py).

- ``strategy.extended._cross_device_ops._launchers``: tf.distribute's `CollectiveReplicaLauncher` per local
  replica (its group key and size, device and ordering token), so tfdist's own collectives join the
  strategy's group and order with its all-reduces; ``FuncGraph.capture_call_time_value`` for instance keys
  drawn when a function runs.
- ``tensorflow.python.ops.collective_ops``: ``all_to_all_v2``, ``all_gather_v2``, ``all_reduce_v2`` (no public wrapper;
  ``CollectiveReduceScatterV2`` exists but is NCCL-only: on CPU "did not find collective implementation").
- ``tensorflow.python.ops.resource_variable_ops.ResourceVariable``: a plain variable inside a strategy's scope.
- ``Operation._add_control_input``, ``Operation._control_outputs``: a control edge to an op already made, and
  the ops an op's control edges lead to (`pacing`: a gradient made after a later bucket's reduce-scatter).

A TensorFlow that moves them makes `launchers` return None (the exact all-reduce fallback is used), the
reduce-scatters unpaced (`CONTROL_EDGES`), and the test fail.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import tensorflow as tf

try:
    from tensorflow.python.ops import collective_ops as _collective_ops
    from tensorflow.python.ops import resource_variable_ops as _resource_variable_ops
except ImportError:  # pragma: no cover - a TensorFlow that moved them.
    _collective_ops = _resource_variable_ops = None

_LAUNCHER_FIELDS = ("_device", "_group_key", "_group_size", "_get_ordering_token")


def launchers(strategy: Any) -> Optional[list[Any]]:
    """The strategy's collective launchers, one per local replica in device order, or None where its
    cross-device reductions are not collective ops (``reduce_to_one``, NCCL's) or TensorFlow moved them."""
    cross = getattr(getattr(strategy, "extended", None), "_cross_device_ops", None)
    found = getattr(cross, "_launchers", None)
    if _collective_ops is None or not found or not all(hasattr(l, f) for l in found for f in _LAUNCHER_FIELDS):
        return None
    return list(found)


# A process's collective executor remembers each (group, instance) key's op type and shape for good, and
# every new strategy's launchers count instance keys from 100 again: an op at a key an earlier strategy's op
# of another type or shape used aborts ("Collective instance 100 expected type 0 ... but got type 4"). tfdist's
# own collectives take keys from a counter of their own per group member that no strategy resets, from 2**28
# up, drawn when the function runs (as the launchers draw theirs), so every member draws the same sequence.
_KEY_START = 1 << 28
_counters: dict = {}
_lock = threading.Lock()


def _draw(member: tuple) -> tf.Tensor:
    with _lock:
        _counters[member] = _counters.get(member, _KEY_START) + 1
        key = _counters[member]
    with tf.device("CPU:0"):
        return tf.constant(key, tf.int32)


def _keys(launcher: Any) -> dict:
    member = (launcher._group_key, launcher._group_size, launcher._device)
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):
        graph = graph.outer_graph
    if not tf.executing_eagerly() and getattr(graph, "building_function", False):
        with graph.as_default():
            key = graph.capture_call_time_value(lambda: _draw(member), tf.TensorSpec([], tf.int32))
    else:
        key = _draw(member)
    return dict(group_size=launcher._group_size, group_key=launcher._group_key, instance_key=key,
                ordering_token=launcher._get_ordering_token())


def all_to_all(tensor: tf.Tensor, launcher: Any) -> tf.Tensor:
    """CollectiveAllToAllV2 of a [N, k] tensor in the launcher's group: row j of the result is what member j
    sent to this one."""
    with tf.device(launcher._device):
        keys = _keys(launcher)
        return _collective_ops.all_to_all_v2(tensor, keys["group_size"], keys["group_key"], keys["instance_key"],
                                             ordering_token=keys["ordering_token"])


def all_gather(tensor: tf.Tensor, launcher: Any) -> tf.Tensor:
    """CollectiveGatherV2 along dimension 0 in the launcher's group, in member order (equal parts: no
    shape gather, no padding)."""
    with tf.device(launcher._device):
        keys = _keys(launcher)
        return _collective_ops.all_gather_v2(tensor, keys["group_size"], keys["group_key"], keys["instance_key"],
                                             ordering_token=keys["ordering_token"])


def all_reduce(tensor: tf.Tensor, launcher: Any) -> tf.Tensor:
    """CollectiveReduceV2: the sum over the launcher's group."""
    with tf.device(launcher._device):
        keys = _keys(launcher)
        return _collective_ops.all_reduce_v2(tensor, keys["group_size"], keys["group_key"], keys["instance_key"],
                                             merge_op="Add", final_op="Id", ordering_token=keys["ordering_token"])


def plain_variable(**kwargs: Any) -> tf.Variable:
    """A ResourceVariable on the current device, whatever strategy's scope is entered."""
    kwargs.pop("experimental_enable_variable_lifting", None)
    return _resource_variable_ops.ResourceVariable(**kwargs)


CONTROL_EDGES = all(hasattr(tf.Operation, n) for n in ("_add_control_input", "_control_outputs"))


def add_control_input(op: tf.Operation, before: tf.Operation) -> None:
    """Makes `op` (already in a graph being built) run after `before`."""
    op._add_control_input(before)


def control_outputs(op: tf.Operation) -> list:
    """The ops that wait for `op` by a control edge."""
    return list(op._control_outputs)


def available() -> list[str]:
    """The private names this TensorFlow lacks (empty where all are where tfdist expects them)."""
    missing = []
    if _collective_ops is None or not all(hasattr(_collective_ops, n)
                                          for n in ("all_to_all_v2", "all_gather_v2", "all_reduce_v2")):
        missing.append("tensorflow.python.ops.collective_ops.all_to_all_v2/all_gather_v2/all_reduce_v2")
    if _resource_variable_ops is None:
        missing.append("tensorflow.python.ops.resource_variable_ops")
    if not CONTROL_EDGES:
        missing.append("tensorflow.python.framework.ops.Operation._add_control_input/_control_outputs")
    try:
        from tensorflow.python.distribute import cross_device_utils
        launcher = cross_device_utils.CollectiveReplicaLauncher
        if not hasattr(launcher, "_get_ordering_token"):
            missing.append("CollectiveReplicaLauncher._get_ordering_token")
        from tensorflow.python.framework.func_graph import FuncGraph
        if not hasattr(FuncGraph, "capture_call_time_value"):
            missing.append("FuncGraph.capture_call_time_value")
    except (ImportError, AttributeError):
        missing.append("tensorflow.python.distribute.cross_device_utils.CollectiveReplicaLauncher")
    return missing

"""A tf.distribute strategy the user built, trained with exactly as the same strategy from `make_strategy`.

`backend_for_strategy(strategy)` finds tfdist's backend of a strategy `make_strategy` built, else wraps the
user's own strategy object, unchanged, in the `Backend` `make_strategy` gives that kind: `MirroredStrategy`
(its devices, its cross-device ops), `MultiWorkerMirroredStrategy` (its cluster resolver's cluster and task,
its communication options), `OneDeviceStrategy`, `TPUStrategy`, TensorFlow's default strategy, and a
`ParameterServerStrategy` on its coordinator (the chief; the user's program runs the worker and ps servers).
Kinds tfdist has no backend for (`CentralStorageStrategy`, TF1's `ParameterServerStrategy`, third-party
subclasses) are refused with a `UserError` saying why. `model_strategy(model)` is the strategy a model was
built under (Keras' record of it, else its variables'), so `tfdist.fit(model, ...)` needs no `strategy=`.

The wrappers are kept by identity (the last `KEEP`, no attribute is set on the user's object), so every call
with one strategy gets one backend and its step-runner thread.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf
from absl import logging

from tfdist.distribute import cluster as cluster_lib, strategies, variable_reads
from tfdist.distribute.backend import Backend, tf_variable
from tfdist.errors import UserError

KEEP = 8
_ADOPTED: list[Backend] = []  # Backends of user-built strategies, newest last.


def adopted(strategy: object) -> Optional[Backend]:
    """The backend already wrapped around the user's `strategy`, or None."""
    return next((backend for backend in _ADOPTED if backend.strategy is strategy), None)


def known_backend(strategy: object) -> Optional[Backend]:
    """tfdist's backend for `strategy` (make_strategy's, or a wrapped user strategy's), or None: never raises."""
    return strategies.backend_of(strategy) or next(
        (backend for backend in strategies._CURRENT if backend.strategy is strategy), None) or adopted(strategy)


def backend_for_strategy(strategy: object) -> Backend:
    """The backend to train with under `strategy`: make_strategy's own, else the user's strategy wrapped."""
    known = known_backend(strategy)
    if known is not None:
        return known
    backend = wrap(strategy)
    variable_reads.install()  # int()/float() of a distributed variable, as make_strategy gives.
    from tfdist import precision as precision_lib

    backend.precision = precision_lib.choose(None, device_kind=backend.device_kind,  # type: ignore[attr-defined]
                                             gpu_compute_capability=backend.gpu_compute_capability)
    logging.info("Strategy %s (built by the program): %s", backend.name, backend.description)
    _ADOPTED.append(backend)
    del _ADOPTED[:-KEEP]
    from tfdist.distribute import barriers

    barriers.report_failures(backend)  # As make_strategy: an uncaught error here ends the other tasks' waits.
    return backend


def model_strategy(model: Any) -> Optional[Any]:
    """The tf.distribute strategy `model` was built under (None: TensorFlow's default, or no variable yet)."""
    recorded = getattr(model, "_distribute_strategy", None)  # Keras' record: the strategy in scope at __init__.
    if recorded is not None:
        return recorded
    for variable in getattr(model, "weights", ()):
        value = tf_variable(variable)
        if isinstance(value, tf.distribute.DistributedValues):
            return value._distribute_strategy
    return None


def wrap(strategy: object) -> Backend:
    """The backend make_strategy gives `strategy`'s kind, around the user's own object."""
    from tensorflow.python.distribute import distribute_lib, tpu_strategy

    name = type(strategy).__name__
    if strategy is distribute_lib._get_default_strategy():
        return Backend("default", strategy, strategies._device_kind(),  # type: ignore[arg-type]
                       description="no distribution (TensorFlow's default strategy)",
                       gpu_compute_capability=strategies.gpu_compute_capability())
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return _multi_worker_mirrored(strategy)
    if isinstance(strategy, (tf.distribute.MirroredStrategy, tf.distribute.OneDeviceStrategy)):
        return _one_process(strategy)
    if isinstance(strategy, (tpu_strategy.TPUStrategyV2, tpu_strategy.TPUStrategy)):
        return Backend("tpu", strategy, "tpu",  # type: ignore[arg-type]
                       description=f"{name} built by the program")
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return _parameter_server(strategy)
    why = {
        "CentralStorageStrategy": "make_strategy has no such kind, and it keeps one copy of each variable on one "
                                  "device where tfdist's backends keep a copy per replica (the replicas' layer "
                                  "state averaged after each execution, a sharded optimizer state: zero_stage); "
                                  "MirroredStrategy over the same devices trains the same model",
        "ParameterServerStrategyV1": "it is TensorFlow 1's, which has no ClusterCoordinator to schedule steps on "
                                     "the workers",
    }.get(name, "tfdist has a backend for TensorFlow's own strategies only")
    raise UserError(
        f"The model was built under a {name}, which tfdist cannot train with: {why}. Build it under "
        "tf.distribute.MirroredStrategy, MultiWorkerMirroredStrategy, OneDeviceStrategy, TPUStrategy or "
        "tf.distribute.experimental.ParameterServerStrategy, or under tfdist.make_strategy(...)'s strategy.")


def _one_process(strategy: Any) -> Backend:
    info = cluster_lib.resolve()
    if info.is_multi_worker:
        raise UserError(
            f"The model was built under a {type(strategy).__name__}, which trains in one process, but {info.source} "
            f"describes a cluster of {info.num_workers} worker(s) and {info.num_ps} ps task(s): each would train a "
            "model of its own. Build it under tf.distribute.MultiWorkerMirroredStrategy (or tfdist.make_strategy()'s "
            "strategy), or unset TF_CONFIG.")
    devices = list(strategy.extended.worker_devices)
    on_gpu = any("gpu" in d.lower() for d in devices)
    kind = "gpu" if on_gpu else "cpu"
    if isinstance(strategy, tf.distribute.OneDeviceStrategy):
        return Backend("one_device", strategy, kind, description=f"OneDeviceStrategy on {devices[0]}, built by the "
                       "program", gpu_compute_capability=strategies.gpu_compute_capability())
    from tensorflow.python.distribute import cross_device_ops

    cross = strategy.extended._cross_device_ops  # Collective ops unless the program chose others.
    return Backend("mirrored", strategy, kind,
                   description=f"MirroredStrategy over {', '.join(devices)}, built by the program (all-reduce: "
                               f"{type(cross).__name__})",
                   gpu_compute_capability=strategies.gpu_compute_capability(),
                   varying_shapes=not isinstance(cross, cross_device_ops.CollectiveAllReduce))


def cluster_of(strategy: Any) -> cluster_lib.ClusterInfo:
    """The cluster and task of a multi-worker strategy, read from its own cluster resolver."""
    resolver = strategy.cluster_resolver or getattr(strategy, "_cluster_resolver", None)  # PS: the strategy's own.
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if not spec or resolver.task_type is None:
        return cluster_lib.LOCAL
    cluster = {role: tuple(tasks if isinstance(tasks, list) else [tasks[i] for i in sorted(tasks)])
               for role, tasks in spec.items()}
    source = {"TFConfigClusterResolver": "TF_CONFIG", "SlurmClusterResolver": "SLURM"}.get(
        type(resolver).__name__, type(resolver).__name__)
    return cluster_lib.ClusterInfo(source, cluster, resolver.task_type, int(resolver.task_id or 0))


def _multi_worker_mirrored(strategy: Any) -> Backend:
    info = cluster_of(strategy)
    pack = strategy.extended._communication_options.bytes_per_pack  # 0: tfdist sizes each step's packs.
    return Backend("multi_worker_mirrored", strategy, strategies._device_kind(), cluster=info, all_tasks_save=True,
                   description=f"MultiWorkerMirroredStrategy built by the program, {max(1, info.num_workers)} "
                               f"worker(s), task {info.label}",
                   gpu_compute_capability=strategies.gpu_compute_capability(), auto_pack=not pack)


def _parameter_server(strategy: Any) -> Backend:
    from tfdist.distribute import parameter_server

    info = cluster_of(strategy)
    parameter_server.check_cluster(info, ps_shards=None)
    if info.task_type != "chief":
        raise UserError(f"The ParameterServerStrategy was built on task {info.label}; tfdist trains on the "
                        "coordinator, the chief (the workers and ps tasks only run their tf.distribute.Server).")
    return parameter_server.ParameterServerBackend(strategy, info)

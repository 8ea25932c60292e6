"""The strategy registry: one place that maps a name to the builder of its backend.

``build_backend(config)`` looks the name up in `REGISTRY`; an unknown name is
a `UserError` listing the valid ones, never a silent fallback. ``auto`` picks
from what the process can see (`resolve_auto`): a TPU (TPU_NAME, or a TPU chip
on the PCI bus) -> tpu; a Horovod launch with Horovod installed -> horovod; a
multi-worker cluster -> multi-worker mirrored or parameter_server;
--num_cpu_replicas or several GPUs -> mirrored; one GPU -> one_device; else
default. It then runs the same option checks as that strategy named
explicitly.
Optional backends import their dependencies lazily, inside their builders.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf
from absl import logging

from tfdist.distribute import barriers, cluster as cluster_lib, variable_reads
from tfdist.distribute.backend import Backend
from tfdist.distribute.options import StrategyOptions
from tfdist.errors import UserError

Builder = Callable[[StrategyOptions], Backend]
REGISTRY: dict[str, Builder] = {}

MIRRORED_ALL_REDUCE = ("auto", "nccl", "hierarchical_copy", "reduce_to_one")
MULTI_WORKER_ALL_REDUCE = ("auto", "ring", "nccl")


def register(name: str) -> Callable[[Builder], Builder]:
    def wrap(builder: Builder) -> Builder:
        REGISTRY[name] = builder
        return builder

    return wrap


def strategy_names() -> list[str]:
    return list(REGISTRY)


def build_backend(config: Any) -> Backend:
    """Builds the backend `config.strategy` names (`StrategyOptions`, or any object with its fields).

    Call before any other TensorFlow work.
    """
    config = StrategyOptions.of(config)
    builder = REGISTRY.get(config.strategy)
    if builder is None:
        raise UserError(
            f"--strategy={config.strategy!r} is not a known strategy; valid strategies "
            f"are: {', '.join(REGISTRY)}."
        )
    _check_options(config)
    backend = builder(config)
    backend.gradient_dtype = config.all_reduce_dtype
    logging.info("Strategy %s: %s", backend.name, backend.description or type(backend.strategy).__name__)
    return backend


def _check_options(config: StrategyOptions) -> None:
    valid = {
        "mirrored": MIRRORED_ALL_REDUCE,
        "multi_worker_mirrored": MULTI_WORKER_ALL_REDUCE,
    }
    strategy = config.strategy
    if strategy != "auto" and config.all_reduce != "auto":
        choices = valid.get(strategy)
        if choices is None:
            raise UserError(
                f"--all_reduce={config.all_reduce} has no effect with --strategy={strategy}; "
                "it applies to mirrored and multi_worker_mirrored. Remove it."
            )
        if config.all_reduce not in choices:
            raise UserError(
                f"--all_reduce={config.all_reduce!r} is not valid with --strategy={strategy}; "
                f"use one of: {', '.join(choices)}."
            )
    if config.all_reduce_pack_mb and strategy not in ("multi_worker_mirrored", "auto"):
        raise UserError(f"--all_reduce_pack_mb applies to --strategy=multi_worker_mirrored, not --strategy={strategy}.")
    if config.all_reduce_dtype != "float32" and strategy in ("parameter_server", "default", "one_device"):
        raise UserError(f"--all_reduce_dtype={config.all_reduce_dtype} applies to strategies that all-reduce "
                        f"gradients (mirrored, multi_worker_mirrored, tpu, horovod), not --strategy={strategy}.")
    if config.ps_shards is not None and strategy not in ("parameter_server", "auto"):
        raise UserError(f"--ps_shards applies to --strategy=parameter_server, not --strategy={strategy}.")
    if config.num_cpu_replicas is not None and strategy not in ("mirrored", "auto"):
        raise UserError(
            f"--num_cpu_replicas applies to --strategy=mirrored, not --strategy={strategy}."
        )
    if config.tpu is not None and strategy not in ("tpu", "auto"):
        raise UserError(
            f"--tpu={config.tpu} was given with --strategy={strategy}; --tpu only applies "
            "to --strategy=tpu (or auto). Remove --tpu or use --strategy=tpu."
        )
    if strategy == "tpu" and config.precision == "mixed_float16":
        raise UserError(
            "--precision=mixed_float16 cannot run on TPUs (they have no float16 arithmetic); "
            "use --precision=mixed_bfloat16 or --precision=auto."
        )
    if (config.hvd_compression or config.hvd_op) and strategy not in ("horovod", "auto"):
        raise UserError(
            f"--hvd_compression/--hvd_op are Horovod options but --strategy={strategy}; "
            "use them with --strategy=horovod or remove them."
        )


def _gpus() -> list:
    return tf.config.list_physical_devices("GPU")


def gpu_compute_capability() -> tuple[int, int] | None:
    gpus = _gpus()
    if not gpus:
        return None
    details = tf.config.experimental.get_device_details(gpus[0])
    return details.get("compute_capability")


def split_cpu(num_replicas: int) -> list[str]:
    """Splits the CPU into `num_replicas` logical devices and returns their names."""
    if _gpus():
        raise UserError(
            f"--num_cpu_replicas={num_replicas} splits the CPU into logical devices, but this "
            f"machine has {len(_gpus())} GPU(s); use --num_gpus instead."
        )
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_replicas)]
        )
    except RuntimeError:
        pass  # Runtime already initialised (tests, notebooks): use what exists.
    logical = tf.config.list_logical_devices("CPU")
    if len(logical) < num_replicas:
        raise UserError(
            f"--num_cpu_replicas={num_replicas}: TensorFlow was already initialised with "
            f"{len(logical)} logical CPU device(s) in this process and cannot be re-split. "
            "Start a new process."
        )
    return [d.name for d in logical[:num_replicas]]


def _check_no_cluster(config: StrategyOptions) -> None:
    info = cluster_lib.resolve()
    if info.is_multi_worker:
        raise UserError(
            f"--strategy={config.strategy} trains in one process, but TF_CONFIG describes a "
            f"cluster of {info.num_workers} worker(s) and {info.num_ps} ps task(s). Use "
            "--strategy=multi_worker_mirrored or parameter_server, or unset TF_CONFIG."
        )


def _device_kind() -> str:
    return "gpu" if _gpus() else "cpu"


def resolve_auto(config: StrategyOptions) -> tuple[str, str]:
    """The strategy ``--strategy=auto`` picks for this process, and why."""
    from tfdist.distribute import horovod_support, tpu

    info = cluster_lib.resolve()
    gpus = _gpus()
    if config.tpu:
        return "tpu", f"--tpu={config.tpu} was given"
    if tpu.tpu_detected():
        return "tpu", "a TPU was found (TPU_NAME, or a TPU chip on the PCI bus)"
    if horovod_support.auto_selects_horovod():
        return "horovod", "horovodrun or mpirun started this process and Horovod is installed"
    if info.is_multi_worker:
        if info.num_ps:
            return "parameter_server", f"{info.source} describes a cluster with ps tasks"
        return "multi_worker_mirrored", f"{info.source} describes a cluster of {info.num_workers} workers"
    if config.num_cpu_replicas:
        return "mirrored", f"--num_cpu_replicas={config.num_cpu_replicas} was given"
    if len(gpus) > 1:
        return "mirrored", f"this machine has {len(gpus)} GPUs"
    if gpus:
        return "one_device", "this machine has one GPU"
    return "default", "no TPU, GPU or cluster was found"


@register("auto")
def _auto(config: StrategyOptions) -> Backend:
    name, why = resolve_auto(config)
    resolved = config.replace(strategy=name)
    try:
        _check_options(resolved)
    except UserError as e:
        raise UserError(f"--strategy=auto chose {name} ({why}), and then: {e}") from None
    logging.info("--strategy=auto chose %s: %s", name, why)
    return REGISTRY[name](resolved)


@register("default")
def _default(config: StrategyOptions) -> Backend:
    _check_no_cluster(config)
    return Backend("default", tf.distribute.get_strategy(), _device_kind(),
                   description="no distribution (TensorFlow's default strategy)",
                   gpu_compute_capability=gpu_compute_capability())


@register("one_device")
def _one_device(config: StrategyOptions) -> Backend:
    _check_no_cluster(config)
    device = "/gpu:0" if _gpus() else "/cpu:0"
    return Backend("one_device", tf.distribute.OneDeviceStrategy(device), _device_kind(),
                   description=f"OneDeviceStrategy on {device}",
                   gpu_compute_capability=gpu_compute_capability())


@register("mirrored")
def _mirrored(config: StrategyOptions) -> Backend:
    _check_no_cluster(config)
    gpus = _gpus()
    if config.num_cpu_replicas is not None:
        devices = split_cpu(config.num_cpu_replicas)
    elif gpus:
        wanted = len(gpus) if config.num_gpus is None else config.num_gpus
        if wanted > len(gpus):
            raise UserError(f"--num_gpus={wanted} but this machine has {len(gpus)} GPU(s).")
        devices = [f"/gpu:{i}" for i in range(wanted)] or ["/cpu:0"]
    elif config.num_gpus:
        raise UserError(
            f"--num_gpus={config.num_gpus} but this machine has no GPU; on CPUs use "
            "--num_cpu_replicas=N to split the CPU into N replicas."
        )
    else:
        devices = ["/cpu:0"]
    on_gpu = any("gpu" in d.lower() for d in devices)
    if config.all_reduce in ("nccl", "hierarchical_copy") and not on_gpu:
        raise UserError(
            f"--all_reduce={config.all_reduce} needs GPUs, and this run's replicas are on "
            "the CPU; use --all_reduce=auto or reduce_to_one."
        )
    cross_device_ops = {
        "auto": None,
        "nccl": tf.distribute.NcclAllReduce,
        "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce,
        "reduce_to_one": tf.distribute.ReductionToOneDevice,
    }[config.all_reduce]
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=cross_device_ops() if cross_device_ops else None
    )
    return Backend("mirrored", strategy, "gpu" if on_gpu else "cpu",
                   description=f"MirroredStrategy over {', '.join(devices)} (all-reduce: {config.all_reduce})",
                   gpu_compute_capability=gpu_compute_capability(), varying_shapes=config.all_reduce != "auto")


@register("multi_worker_mirrored")
def _multi_worker_mirrored(config: StrategyOptions) -> Backend:
    info = cluster_lib.resolve()
    for role in ("ps", "evaluator"):
        if role in info.cluster or info.task_type == role:
            raise UserError(
                f"TF_CONFIG has a {role} task, but --strategy=multi_worker_mirrored trains "
                "with chief and worker tasks only; remove the ps/evaluator entries or use "
                "--strategy=parameter_server."
            )
    implementation = {
        "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
        "ring": tf.distribute.experimental.CommunicationImplementation.RING,
        "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
    }[config.all_reduce]
    if config.all_reduce == "nccl" and not _gpus():
        raise UserError("--all_reduce=nccl needs GPUs and this machine has none; use ring or auto.")
    options = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=int((config.all_reduce_pack_mb or 0) * 2**20),  # None: each step's, `backend.pack_bytes`.
        implementation=implementation,
        timeout_seconds=config.collective_timeout_s or None,
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=cluster_lib.tf_cluster_resolver(info), communication_options=options,
    )
    return Backend("multi_worker_mirrored", strategy, _device_kind(), cluster=info, all_tasks_save=True,
                   description=f"MultiWorkerMirroredStrategy, {max(1, info.num_workers)} worker(s), "
                               f"task {info.label}, all-reduce {config.all_reduce}",
                   gpu_compute_capability=gpu_compute_capability(), auto_pack=config.all_reduce_pack_mb is None)


@register("parameter_server")
def _parameter_server(config: StrategyOptions) -> Backend:
    from tfdist.distribute import parameter_server

    return parameter_server.build(cluster_lib.resolve(), ps_shards=config.ps_shards)


@register("tpu")
def _tpu(config: StrategyOptions) -> Backend:
    import os

    from tfdist.distribute import tpu

    address = config.tpu or os.environ.get("TPU_NAME") or "local"
    strategy = tpu.connect(address, zone=config.tpu_zone, project=config.gcp_project)
    return Backend("tpu", strategy, "tpu",
                   description=f"TPUStrategy on --tpu={address} ({strategy.num_replicas_in_sync} cores)")


@register("horovod")
def _horovod(config: StrategyOptions) -> Backend:
    from tfdist.distribute import horovod_support

    return horovod_support.build_backend(op=config.hvd_op or "average", compression=config.hvd_compression or "none")


# The public factory ------------------------------------------------------------------
BACKEND_ATTRIBUTE = "_tfdist_backend"
_CURRENT: list[Backend] = []
STRATEGY_OPTIONS = ("num_gpus", "num_cpu_replicas", "all_reduce", "all_reduce_dtype", "all_reduce_pack_mb",
                    "collective_timeout_s", "tpu", "tpu_zone",
                    "gcp_project", "hvd_compression", "hvd_op", "ps_shards", "precision")


def remember(backend: Backend) -> None:
    """Makes `backend` the one `tfdist.fit` uses by default (and for its strategy object).

    The backend hangs on the strategy object tfdist made, so both go once the caller drops the
    strategy and a newer `make_strategy` replaced it (no registry keeps every one of a notebook's).
    """
    setattr(backend.public_strategy, BACKEND_ATTRIBUTE, backend)
    _CURRENT[:] = [backend]


def backend_of(strategy: object) -> Backend | None:
    backend = getattr(strategy, BACKEND_ATTRIBUTE, None)
    return backend if isinstance(backend, Backend) and backend.public_strategy is strategy else None


def current_backend() -> Backend:
    """The backend of the last `make_strategy` call, else TensorFlow's default strategy."""
    if _CURRENT:
        return _CURRENT[0]
    backend = build_backend(StrategyOptions(strategy="default"))
    remember(backend)
    return backend


def _exit_served_task() -> None:
    """Ends a task that only served: atexit handlers (logging's flush among them), streams, then os._exit(0)."""
    barriers.exit_now(0)


def make_strategy(name: str = "auto", **options: object) -> object:
    """Builds the named strategy; returns the tf.distribute.Strategy (or tfdist's Horovod wrapper).

    `options` are the flags of the same names (num_cpu_replicas=2, all_reduce="ring", tpu="local",
    precision="auto", ...). Keras' global dtype policy is left as it is unless `precision` is given: a
    policy name sets it, "auto" chooses one for the device (tfdist.precision), before the model is built. On a
    parameter-server job's worker and ps tasks this serves until the chief has finished and then ends
    the process with status 0, so one script runs unchanged on every task: the process's exit handlers
    run, then it leaves without the interpreter's teardown of a live gRPC server (which TensorFlow cannot
    stop, and which can stall or abort a finished task).
    """

    from tfdist import precision as precision_lib

    unknown = sorted(set(options) - set(STRATEGY_OPTIONS))
    if unknown:
        raise UserError(f"make_strategy got unknown option(s) {', '.join(unknown)}; valid options are "
                        f"{', '.join(STRATEGY_OPTIONS)}.")
    config = StrategyOptions(strategy=name, **options)  # type: ignore[arg-type]
    config.validate()
    variable_reads.install()  # int()/float() of a distributed variable, as of a plain one.
    backend = build_backend(config)
    if backend.serve():
        backend.shutdown()
        logging.info("[%s] served until the chief finished; exiting.", backend.task_label)
        _exit_served_task()
    choice = precision_lib.choose(config.precision, device_kind=backend.device_kind,
                                  gpu_compute_capability=backend.gpu_compute_capability)
    if config.precision is not None:  # None: the user's policy stays, untouched.
        precision_lib.apply(choice, device_kind=backend.device_kind)
    backend.precision = choice
    logging.info("[%s] precision %s (%s)", backend.task_label, choice.policy, choice.reason)
    remember(backend)
    barriers.report_failures(backend)  # An uncaught error here ends the other tasks' waits with it.
    return backend.public_strategy

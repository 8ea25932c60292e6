"""Optional Horovod: availability checks, and the Horovod backend.

Horovod is imported only when the backend is built. Horovod 0.28.1 (its last
release) builds against TensorFlow <= 2.18 only, and its Keras helpers assume
Keras 2; tfdist uses only its core TensorFlow ops (grouped all-reduce,
broadcast), which work with Keras 3.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfdist.distribute.backend import Backend, tf_variable
from tfdist.distribute.gradients import compress, decompress
from tfdist.errors import UserError

INSTALL_HINT = (
    "Install it with TensorFlow 2.18 (horovod 0.28.1 does not build against TensorFlow >= 2.19): "
    "pip install 'tensorflow==2.18.1' && HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 "
    "HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 "
    "pip install --no-build-isolation 'tfdist[horovod]'"
)


def is_horovod_available() -> bool:
    """Whether the horovod package is installed (its TensorFlow ops may still fail to load)."""
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


# Set by horovodrun (Gloo mode) and Horovod's own launchers, in Horovod jobs only.
HOROVOD_LAUNCHER_ENV = ("HOROVOD_RANK", "HOROVOD_GLOO_RENDEZVOUS_ADDR")
# Set by MPI launchers for any program: Open MPI's mpirun (which horovodrun uses
# in MPI mode) and PMI-based launchers (srun --mpi=pmi2, MPICH, Intel MPI).
OPEN_MPI_SIZE_ENV = "OMPI_COMM_WORLD_SIZE"
PMI_SIZE_ENV = "PMI_SIZE"
LAUNCHER_ENV = (*HOROVOD_LAUNCHER_ENV, OPEN_MPI_SIZE_ENV, PMI_SIZE_ENV)


def _size(environ: Mapping[str, str], key: str) -> int:
    try:
        return int(environ.get(key, "0"))
    except ValueError:
        return 0


def started_by_launcher(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether horovodrun, mpirun or an MPI-aware srun started this process (one rank or more).

    What an explicit ``--strategy=horovod`` requires. It says nothing about
    whether the job is meant for Horovod: see `auto_selects_horovod`.
    """
    environ = os.environ if environ is None else environ
    return any(key in environ for key in LAUNCHER_ENV)


def auto_selects_horovod(environ: Optional[Mapping[str, str]] = None,
                         available: Optional[bool] = None) -> bool:
    """Whether ``--strategy=auto`` should pick Horovod.

    Only when Horovod is installed and the process was started for Horovod:
    by horovodrun (HOROVOD_RANK or HOROVOD_GLOO_RENDEZVOUS_ADDR set), by Open
    MPI's mpirun with more than one rank (OMPI_COMM_WORLD_SIZE > 1), or by a
    PMI launcher with more than one rank (PMI_SIZE > 1) *and* a HOROVOD_*
    setting in the environment. A bare PMI_SIZE is not enough: srun
    --mpi=pmi2 sets it for every multi-task SLURM step, which tfdist otherwise
    trains as a TensorFlow multi-worker cluster.
    """
    environ = os.environ if environ is None else environ
    if not (is_horovod_available() if available is None else available):
        return False
    if any(environ.get(key) for key in HOROVOD_LAUNCHER_ENV):
        return True
    if _size(environ, OPEN_MPI_SIZE_ENV) > 1:
        return True
    return _size(environ, PMI_SIZE_ENV) > 1 and any(key.startswith("HOROVOD_") for key in environ)


def import_horovod() -> Any:
    """Imports horovod.tensorflow or raises a `UserError` that says how to install it."""
    if not is_horovod_available():
        raise UserError(f"--strategy=horovod needs Horovod, which is not installed. {INSTALL_HINT}")
    try:
        import horovod.tensorflow as hvd
    except Exception as e:  # Built for another TensorFlow, or without TensorFlow support.
        raise UserError(
            f"Horovod is installed but its TensorFlow support cannot be loaded ({' '.join(str(e).split())[:300]}); "
            f"it was built without TensorFlow or for another TensorFlow version. Reinstall it: {INSTALL_HINT}"
        ) from None
    return hvd


class HorovodStrategy:
    """What `tfdist.make_strategy("horovod")` returns: the strategy surface a user touches, over Horovod.

    One replica per process: `run` calls the function, `reduce` all-reduces
    across ranks, datasets are sharded by rank like tf.distribute's input
    contexts.
    """

    def __init__(self, backend: "HorovodBackend"):
        self._backend = backend

    def scope(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @property
    def num_replicas_in_sync(self) -> int:
        return int(self._backend.hvd.size())

    def run(self, fn: Callable, args: Sequence[Any] = (), kwargs: Optional[dict] = None) -> Any:
        return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op: Any, value: Any, axis: Optional[int] = None) -> Any:
        hvd = self._backend.hvd
        mean = str(getattr(reduce_op, "value", reduce_op)).upper() == "MEAN"
        if axis is not None:
            value = tf.reduce_mean(value, axis) if mean else tf.reduce_sum(value, axis)
        return hvd.allreduce(value, op=hvd.Average if mean else hvd.Sum)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Iterable:
        return self._backend.distribute_dataset(dataset_fn)

    def experimental_local_results(self, value: Any) -> tuple:
        return (value,)


class HorovodBackend(Backend):
    """Horovod's core TensorFlow ops behind the surface every backend presents.

    One replica per process; each rank reads its own shard through the same
    `InputContext` mechanism as tf.distribute; gradients are all-reduced with
    one grouped all-reduce; rank 0 is the only writer. Horovod's Keras helpers
    (`horovod.tensorflow.keras`) assume Keras 2 and are not used.
    """

    def __init__(self, hvd: Any, *, op: str = "average", compression: str = "none", device_kind: str = "cpu"):
        super().__init__("horovod", tf.distribute.get_strategy(), device_kind,
                         description=f"Horovod rank {hvd.rank()} of {hvd.size()} (op {op}, compression "
                                     f"{compression})")
        self.hvd = hvd
        self.op = op
        self._hvd_op = hvd.Adasum if op == "adasum" else hvd.Sum
        self._compression = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none

    @property
    def num_replicas(self) -> int:
        return int(self.hvd.size())

    @property
    def num_workers(self) -> int:
        return int(self.hvd.size())

    @property
    def worker_index(self) -> int:
        return int(self.hvd.rank())

    @property
    def is_chief(self) -> bool:
        return self.hvd.rank() == 0

    @property
    def task_label(self) -> str:
        return f"rank:{self.hvd.rank()}"

    def scope(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def distribute_dataset(self, dataset_fn: Callable) -> Iterable:
        size = int(self.hvd.size())
        dataset = dataset_fn(tf.distribute.InputContext(num_input_pipelines=size,
                                                        input_pipeline_id=int(self.hvd.rank()),
                                                        num_replicas_in_sync=size))
        if self.device_kind == "gpu":  # Like tf.distribute's fetch-to-device: batches wait on the GPU.
            dataset = dataset.apply(tf.data.experimental.prefetch_to_device("/gpu:0"))
        return dataset

    def run(self, fn: Callable, args: Sequence[Any]) -> Any:
        return fn(*args)

    def reduce_sum(self, value: Any) -> tf.Tensor:
        return self.hvd.allreduce(value, op=self.hvd.Sum)

    def sum_rows_each_step(self, steps_per_execution: int) -> bool:
        return False  # Horovod's grouped all-reduce takes dense tensors only.

    def finish_gradients(self, grads: list[Any], distinct_rows: bool = False) -> list[Any]:
        # Each rank's loss is its share of the global batch's loss (tfdist.training.steps),
        # so summing gives the global-batch gradient. Adasum combines per-rank
        # gradients of each rank's whole loss. Sparse gradients go dense: Horovod's grouped
        # all-reduce takes dense tensors only.
        present = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]
        if self.op == "adasum":
            present = [g * float(self.hvd.size()) for g in present]
        sent = compress(present, self.gradient_dtype)
        reduced = self.hvd.grouped_allreduce(sent, op=self._hvd_op, compression=self._compression)
        reduced = iter(decompress(reduced, present))
        return [None if g is None else next(reduced) for g in grads]

    def local_replicas(self) -> list[tuple[int, str]]:
        return [(self.hvd.rank(), "/gpu:0" if self.device_kind == "gpu" else "/cpu:0")]

    def replica_index(self) -> int:
        return self.hvd.rank()

    def all_gather(self, tensor: tf.Tensor, name: str) -> Optional[tf.Tensor]:
        # Named: Horovod matches ranks' collectives by name, which it would otherwise take from the input's
        # op, and a rank with nothing to send builds another op than one with something.
        return self.hvd.allgather(tensor, name=name) if self.hvd.size() > 1 else tensor

    def all_sum(self, tensors: list[tf.Tensor], name: str) -> list[tf.Tensor]:
        if self.hvd.size() == 1:
            return list(tensors)
        return [self.hvd.allreduce(t, op=self.hvd.Sum, name=f"{name}_{j}") for j, t in enumerate(tensors)]

    @property
    def public_strategy(self) -> HorovodStrategy:
        if getattr(self, "_public", None) is None:
            self._public = HorovodStrategy(self)
        return self._public

    def replica_sum(self) -> Optional[Callable[[list], list]]:
        if self.hvd.size() == 1:
            return None
        return lambda tensors: self.hvd.grouped_allreduce(tensors, op=self.hvd.Sum)

    def sync_replica_state(self, variables: Sequence[Any]) -> None:
        if not variables or self.hvd.size() == 1:
            return
        values = [tf_variable(v) for v in variables]
        means = self.hvd.grouped_allreduce([tf.identity(v) for v in values], op=self.hvd.Average)
        for variable, mean in zip(values, means):
            variable.assign(mean)

    def broadcast_initial_state(self, variables: Sequence[Any]) -> None:
        self.hvd.broadcast_variables([tf_variable(v) for v in variables], root_rank=0)

    def gather_from_tasks(self, row: np.ndarray) -> np.ndarray:
        return np.asarray(self.hvd.allgather(tf.constant(row)[None]))

    def local_replica_values(self, variable: Any) -> list[np.ndarray]:
        return [np.asarray(tf_variable(variable))]


def build_backend(*, op: str, compression: str) -> Backend:
    """Initialises Horovod (under horovodrun) and returns its backend."""
    if not started_by_launcher():
        raise UserError(
            "--strategy=horovod runs one process per rank and must be started by horovodrun (or mpirun), "
            "e.g. horovodrun -np 2 -H localhost:2 --gloo tfdist-train --strategy=horovod. For one process, "
            "use --strategy=default or mirrored."
        )
    hvd = import_horovod()
    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:  # One GPU per rank, chosen by local rank.
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
        tf.config.experimental.set_memory_growth(gpus[hvd.local_rank() % len(gpus)], True)
    if op == "adasum" and not hvd.mpi_built():
        raise UserError(
            "--hvd_op=adasum needs Horovod built with MPI (its Adasum runs over MPI, with NCCL on GPUs); this "
            "Horovod was built without MPI. Use --hvd_op=average, or rebuild Horovod with HOROVOD_WITH_MPI=1."
        )
    return HorovodBackend(hvd, op=op, compression=compression, device_kind="gpu" if gpus else "cpu")

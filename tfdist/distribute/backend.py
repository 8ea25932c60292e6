"""The one small surface every backend presents to the training loop.

`Backend` wraps a `tf.distribute.Strategy` and adds what the loop needs and
tf.distribute spells differently per strategy: topology (replicas, workers,
chief), how to feed data, run a replica step, sum results across replicas,
finish gradients, and execute a compiled function. Backends that are not
tf.distribute strategies (Horovod) subclass it and override the few methods
that differ, so the training loop (`tfdist.training`) never branches on the backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfdist.distribute import barriers
from tfdist.distribute.cluster import LOCAL, ClusterInfo
from tfdist.distribute.gradients import compress, decompress, sum_rows
from tfdist.distribute.runner import Runner, _summaries_as, _summary_state, wait_until_closed  # noqa: F401


def tf_variable(variable: Any) -> Any:
    """The TensorFlow variable behind a Keras 3 variable (a tf.Variable is returned as is)."""
    if isinstance(variable, tf.Variable):
        return variable
    return getattr(variable, "value", variable)


# tfdist's all-reduce packs: about PACKS a step, each MIN_PACK_BYTES to MAX_PACK_BYTES. Small packs let the
# first all-reduce start while the backward pass runs; MWMS chains its collectives, each paying the ring's
# latency, so a large model gets larger packs, not more (docs/benchmarks.md, overlap).
PACKS, MIN_PACK_BYTES, MAX_PACK_BYTES = 8, 4 * 2**20, 64 * 2**20


def pack_bytes(tensors: Sequence[Any]) -> int:
    """The pack size for one step's gradients: an eighth of their bytes, within 4 to 64 MB."""
    total = sum(t.shape.num_elements() * t.dtype.size for t in tensors
                if isinstance(t, tf.Tensor) and t.shape.is_fully_defined())
    return int(min(MAX_PACK_BYTES, max(MIN_PACK_BYTES, total // PACKS)))


@dataclasses.dataclass
class Backend:
    """A tf.distribute strategy as the training loop sees it."""

    name: str
    strategy: tf.distribute.Strategy
    device_kind: str = "cpu"  # "cpu", "gpu" or "tpu".
    cluster: ClusterInfo = LOCAL
    description: str = ""
    gpu_compute_capability: tuple[int, int] | None = None
    # Whether every task must take part in each checkpoint save (tf.distribute
    # multi-worker strategies: the save involves collectives). Otherwise only
    # the chief saves.
    all_tasks_save: bool = False
    # Whether input is sharded deterministically by input context (every
    # synchronous strategy). Parameter-server workers take steps dynamically,
    # so each reads the whole training set in its own random order instead.
    sharded_input: bool = True
    # "bfloat16": gradients travel in bfloat16 (half the bytes) and are summed back in their own dtype.
    gradient_dtype: str = "float32"
    # Whether the all-reduce takes a shape that changes from step to step within one compiled execution
    # (`sum_rows`): MirroredStrategy's cross-device reductions (nccl, hierarchical_copy, reduce_to_one) do;
    # collective ops (its default, MultiWorkerMirrored's) keep an execution's first shape and abort on another.
    varying_shapes: bool = False
    # Whether the all-reduce's pack size is tfdist's to choose (MWMS without --all_reduce_pack_mb): `pack_bytes`.
    auto_pack: bool = False

    # What `tfdist.make_strategy` returns: the tf.distribute strategy itself.
    @property
    def public_strategy(self) -> Any:
        return self.strategy

    # Topology ---------------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        return int(self.strategy.num_replicas_in_sync)

    @property
    def num_workers(self) -> int:
        return max(1, self.cluster.num_workers)

    @property
    def worker_index(self) -> int:
        return self.cluster.worker_index

    @property
    def is_chief(self) -> bool:
        return self.cluster.is_chief

    @property
    def task_label(self) -> str:
        return self.cluster.label

    # Execution ----------------------------------------------------------------
    def scope(self) -> contextlib.AbstractContextManager:
        return self.strategy.scope()

    def distribute_dataset(self, dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset]) -> Iterable:
        return self.strategy.distribute_datasets_from_function(dataset_fn)

    def run(self, fn: Callable, args: Sequence[Any]) -> Any:
        return self.strategy.run(fn, args=tuple(args))

    def reduce_sum(self, per_replica: Any) -> tf.Tensor:
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def sum_rows_each_step(self, steps_per_execution: int) -> bool:
        """Whether sparse inputs' row gradients can be summed as rows (`sum_rows`) in executions of this many
        steps: under a collective all-reduce only one step at a time; Horovod sums them dense; parameter-server
        workers apply their own, dense (as before rows were summed)."""
        if self.asynchronous:
            return False
        return self.varying_shapes or self.num_replicas == 1 or steps_per_execution == 1

    def finish_gradients(self, grads: list[Any], distinct_rows: bool = False) -> list[Any]:
        """Sums a replica's gradients across all replicas and workers (inside a replica).

        `None` gradients (unused weights) stay `None`; sparse gradients
        (`IndexedSlices`, from embeddings) are all-reduced as such. With `distinct_rows` (a sparse input's
        kernel gradient: each replica's own unique rows, their number differing by replica) every
        `IndexedSlices` is summed as unique rows instead (`sum_rows`).
        """
        context = tf.distribute.get_replica_context()
        summed = {i: sum_rows(g, context, self) for i, g in enumerate(grads)
                  if distinct_rows and isinstance(g, tf.IndexedSlices)}
        present = [g for i, g in enumerate(grads) if g is not None and i not in summed]
        if context is None or not present or self.num_replicas == 1:
            return [summed.get(i, g) for i, g in enumerate(grads)]
        sent = compress(present, self.gradient_dtype)
        options = None
        if self.auto_pack:  # Packs sent last layers first (TensorFlow reverses the list): overlap the backward.
            options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=pack_bytes(sent))
        reduced = iter(decompress(context.all_reduce(tf.distribute.ReduceOp.SUM, sent, options=options), present))
        return [summed[i] if i in summed else None if g is None else next(reduced) for i, g in enumerate(grads)]

    # What a sharded optimizer state needs (`tfdist.training.zero`) ------------------------------
    def local_replicas(self) -> list[tuple[int, str]]:
        """(Global replica index, device) of each replica this process runs, in the order of a distributed
        variable's local copies."""
        try:
            devices = list(self.strategy.extended.worker_devices)
        except RuntimeError:  # TensorFlow's default strategy: one replica, placed as TensorFlow places it.
            return [(0, "")]
        base = self.worker_index * len(devices)
        return [(base + j, device) for j, device in enumerate(devices)]

    def replica_index(self) -> int:
        """The global index of the replica being traced (inside a replica step; a Python int)."""
        context = tf.distribute.get_replica_context()
        index = tf.get_static_value(context.replica_id_in_sync_group)
        if index is None:  # TPUs: one trace for every core.
            raise ValueError("This strategy traces one step for all replicas; no replica index.")
        return int(index)

    def all_gather(self, tensor: tf.Tensor, name: str) -> Optional[tf.Tensor]:
        """The replicas' `tensor`s (dimension 0 may differ) concatenated in replica order, inside a replica
        step; None where this backend's reductions cannot gather (then sum zero-filled tensors instead).
        `name`: the same on every replica for the same collective (Horovod matches collectives by name)."""
        extended = self.strategy.extended
        cross = getattr(extended, "_cross_device_ops", None)
        if self.num_replicas > 1 and type(cross).__name__ != "CollectiveAllReduce":
            return None
        return tf.distribute.get_replica_context().all_gather(tensor, axis=0)

    def all_sum(self, tensors: list[tf.Tensor], name: str) -> list[tf.Tensor]:
        """Sums `tensors` over the replicas in their own dtype (inside a replica step; no compression);
        `name` as for `all_gather`."""
        if self.num_replicas == 1:
            return list(tensors)
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, list(tensors))

    def replica_sum(self) -> Optional[Callable[[list], list]]:
        """Sums tensors over the replicas inside a step where TensorFlow has no replica context to (Horovod),
        or None: tf.distribute's replica context does (`BatchNormalization(synchronized=True)`)."""
        return None

    def sync_replica_state(self, variables: Sequence[Any]) -> None:
        """Averages replica-local state across replicas (called in cross-replica context, compiled)."""
        if not variables or self.num_replicas == 1:
            return
        values = [tf_variable(v) for v in variables]

        def average() -> None:
            context = tf.distribute.get_replica_context()
            means = context.all_reduce(tf.distribute.ReduceOp.MEAN, [tf.identity(v) for v in values])
            for variable, mean in zip(values, means):
                variable.assign(mean)

        self.strategy.run(average)

    def compile(self, fn: Callable) -> Callable:
        return tf.function(fn)

    def apply_step(self, apply: Callable[[list], Any], counter: tf.Variable, ready: Sequence[Any] = (),
                   variables: Sequence[Any] = ()) -> None:
        """Applies one replica step's updates (`apply(ready)`) and counts the step in `counter` (compiled, per
        replica).

        `ready`: the step's gradients (None entries allowed), of `variables`. The parameter-server
        backend overrides it: there an execution may run again on another worker,
        and it applies only the steps not yet applied, deciding once `ready` is; `apply` gets the
        gradients as copied to their variables' ps.
        """
        apply(list(ready))
        counter.assign_add(1)

    def claim(self, ready: Sequence[Any] = ()) -> Any:
        """A step's claim to apply its updates (compiled; parameter servers: see `apply_step`), or None: always."""
        return None

    def when_claimed(self, claimed: Any, fn: Callable[[], Any]) -> None:
        """Runs `fn` (one of the step's updates) if the step's `claim` holds (compiled)."""
        fn()

    @property
    def single_controller(self) -> bool:
        """Whether one process drives the whole job (else every worker runs the loop in lockstep)."""
        return self.num_workers == 1

    # How many compiled training executions may be outstanding at once: 2 for
    # synchronous strategies (one running, the next queued behind it, so the
    # host's work on one execution's results overlaps the next execution); more
    # where workers run them asynchronously (parameter servers).
    max_in_flight: int = 2
    # Whether workers update shared variables concurrently (parameter servers):
    # read-modify-write updates of shared state must then be atomic increments.
    asynchronous: bool = False
    _runner: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def execute(self, compiled: Callable, *args: Any) -> np.ndarray:
        """Runs a compiled function in this process and returns its result on the host."""
        return np.asarray(compiled(*args))

    def dispatch(self, compiled: Callable, *args: Any) -> Any:
        """Queues one training execution behind those already dispatched; `fetch` returns its result.

        Executions run in order on one thread of their own (under this backend's
        scope), so the caller can dispatch execution k+1 before it fetches k and
        works on k's results while k+1 runs.
        """
        if self._runner is None:
            self._runner = Runner()
        return self._runner.submit(self._call_in_scope, compiled, args, _summary_state())

    def _call_in_scope(self, compiled: Callable, args: tuple, summaries: dict) -> np.ndarray:
        # The strategy scope is per thread; Keras reads it while tracing. So is tf.summary's default writer:
        # the caller's (a TensorBoard callback's, for tf.summary calls inside the model) is the runner's too.
        with self.scope(), _summaries_as(summaries):
            return self.execute(compiled, *args)

    def fetch(self, handle: Any) -> np.ndarray:
        """Waits for a dispatched execution; returns its result (re-raising its error)."""
        return handle.result()

    def abandon(self, handle: Any, wait: bool) -> None:
        """Gives up a dispatched execution whose result is no longer wanted (the loop is failing).

        With `wait` (every worker fails alike, e.g. on a non-finite loss) it waits
        for the execution to finish, so the model is not changed after the error
        reaches the caller. Without it (an execution failed here, perhaps here
        only, or a second Ctrl-C) it cancels the execution if it has not started
        and does not wait: one that has may wait forever in a collective.
        """
        if not wait:
            handle.cancel()
            return
        try:
            handle.result()
        except Exception:  # The loop is already failing with the error that matters.
            pass

    # Evaluation goes through these; backends whose workers cannot evaluate an
    # exact split (parameter servers) evaluate in the coordinating process.
    def distribute_eval_dataset(self, dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset]) -> Iterable:
        return self.distribute_dataset(dataset_fn)

    def run_eval(self, fn: Callable, args: Sequence[Any]) -> Any:
        return self.run(fn, args)

    def reduce_eval(self, value: Any) -> tf.Tensor:
        return self.reduce_sum(value)

    def broadcast_initial_state(self, variables: Sequence[Any]) -> None:
        """Makes every replica start from the same values (tf.distribute already does)."""

    def gather_from_tasks(self, row: np.ndarray) -> np.ndarray:
        """Every task's `row`, stacked (one collective; all tasks must call it together)."""
        value = tf.constant(row)

        @tf.function
        def gather() -> Any:
            return self.strategy.run(
                lambda: tf.distribute.get_replica_context().all_gather(value[None], axis=0))

        return np.asarray(self.strategy.experimental_local_results(gather())[0])

    def local_replica_values(self, variable: Any) -> list[np.ndarray]:
        """The values of one (Keras) variable on each local replica."""
        return [np.asarray(v) for v in self.strategy.experimental_local_results(tf_variable(variable))]

    def report_placement(self, variables: Sequence[Any]) -> None:
        """Logs where the model's variables live, where that is worth knowing."""

    def serve(self) -> bool:
        """Runs this task's server role, if it has one, until the job ends; True if it did.

        Tasks that only serve (parameter servers, parameter-server workers)
        return True after the chief has finished; training tasks return False.
        """
        return False

    def release_runner(self, finished: bool = True) -> None:
        """Ends the step-runner thread; every `tfdist.fit` call does on its way out, returned or raised.

        `dispatch` makes a new one for the next fit on this backend. `finished`
        (fit returned, or every task stopped together on a preemption request):
        on a synchronous multi-worker job, the task that hosts TensorFlow's
        coordination service then waits at exit until the other tasks have exited
        (`leave_last`).
        """
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.close()
        if finished:
            self.leave_last()

    def leave_last(self) -> None:
        """On a synchronous multi-worker job: no training task exits while another still works, and a task that
        fails tells the others instead of waiting (`tfdist.distribute.barriers.leave_last`)."""
        barriers.leave_last(self)

    def wait_for_peers(self) -> None:
        """The end of a fit: on a synchronous multi-worker job, returns once every task has finished it (the
        chief's callbacks and exports included); a peer's failure raises its error
        (`tfdist.distribute.barriers.wait_for_peers`)."""
        barriers.wait_for_peers(self)

    def shutdown(self) -> None:
        """Releases cluster resources at the end of a run."""
        self.release_runner(finished=False)

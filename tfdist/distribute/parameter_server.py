"""Parameter-server training with Keras 3, through tf.distribute's ClusterCoordinator.

Keras 3's `model.fit` has no ParameterServerStrategy path, so tfdist drives it
itself: the chief is the coordinator and runs tfdist's training loop, whose
compiled multi-step function is *scheduled* onto the workers (several in
flight at once, asynchronously); the model, optimizer and step-counter
variables live on the parameter servers, placed round-robin across them
(whole; only `tfdist.layers.ShardedEmbedding` tables are split into row
shards, ``--ps_shards`` of them, one per ps task by default).
Workers and parameter servers run a TensorFlow server and serve until the
chief has finished, then exit 0.

Evaluation runs inline on the chief (every held-out example exactly once;
scheduling onto workers cannot guarantee that). Steps are counted on the chief
as scheduled functions finish; the ClusterCoordinator re-schedules a function
whose worker died, so training carries on when a worker is lost, and a
restarted worker rejoins. A lost parameter server fails the job with an error
naming it; relaunching resumes from the last checkpoint.

A re-scheduled function runs again from its first step, while the steps the
dead worker finished are already in the variables. So each scheduled execution
gets a *slot* in a progress vector on the ps (`ProgressSlots`): the chief sets
it to minus the execution's step count, each step claims one (an increment on
the ps) once its gradients are ready and applies its updates (and counts
itself in the step counter) only if its claim is within the count. A re-run
thus applies only the steps the dead worker had not claimed, and the steps
applied equal the steps counted. What is left: a worker killed between its
claim and the end of that step's updates leaves that one step unapplied or
partly applied.

The claim costs no round trip of its own: each gradient is copied to its
variable's ps as soon as it is ready (`_staged`), the claim and the cond run on
the ps holding the slots, and only the claim's answer travels from there to
the other ps tasks. Left on the worker, a gradient waited for the answer (a
lowered cond's Switch sits with its input) and only then left: two trips a
step, the small one queued on a busy link behind the other workers' transfers.
A custom train_step's updates (`claim`, `when_claimed`) are not staged: their
gradients still wait on the worker for the answer.
"""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import tensorflow as tf
from absl import logging

from tfdist.distribute.backend import Backend, tf_variable
from tfdist.distribute.cluster import ClusterInfo
from tfdist.errors import UserError

CHIEF_WAIT_S = 300.0


def check_cluster(info: ClusterInfo, *, ps_shards: int | None) -> None:
    if info.source == "local" or not info.is_multi_worker:
        raise UserError(
            "--strategy=parameter_server needs a cluster with a chief, workers and ps tasks in TF_CONFIG, e.g. "
            "tfdist-launch --num_workers=2 --num_ps=1 -- tfdist-train --strategy=parameter_server."
        )
    missing = [role for role in ("chief", "worker", "ps") if role not in info.cluster]
    if missing:
        raise UserError(
            f"--strategy=parameter_server needs chief, worker and ps tasks, but TF_CONFIG has no "
            f"{' and no '.join(missing)} (it has {', '.join(sorted(info.cluster))}). With tfdist-launch give "
            "--num_ps=1 or more."
        )
    if info.task_type == "evaluator":
        raise UserError("tfdist evaluates inline on the chief; remove the evaluator task from TF_CONFIG.")
    if ps_shards is not None and ps_shards < 1:
        raise UserError(
            f"--ps_shards={ps_shards}: give 1 or more (how many row shards each tfdist.layers.ShardedEmbedding "
            f"table is split into over the {info.num_ps} ps task(s); by default one per ps task).")


def _server_config(info: ClusterInfo) -> tf.compat.v1.ConfigProto:
    # With few cores, a worker whose inter-op pool is smaller than the number
    # of concurrent remote calls deadlocks; give it one thread more than workers.
    return tf.compat.v1.ConfigProto(inter_op_parallelism_threads=len(info.cluster.get("worker", ())) + 2)


def _reachable(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False


class ServerTask(Backend):
    """A worker or ps task: serves until the chief has come and gone."""

    def __init__(self, info: ClusterInfo):
        super().__init__("parameter_server", tf.distribute.get_strategy(), "cpu", cluster=info,
                         description=f"{info.label} serving for the chief at {info.cluster['chief'][0]}")

    @property
    def is_chief(self) -> bool:
        return False

    def serve(self) -> bool:
        info = self.cluster
        server = tf.distribute.Server(
            tf.train.ClusterSpec({k: list(v) for k, v in info.cluster.items()}), job_name=info.task_type,
            task_index=info.task_index, protocol="grpc", config=_server_config(info), start=True,
        )
        chief = info.cluster["chief"][0]
        logging.info("[%s] serving at %s until the chief (%s) finishes.", info.label, server.target, chief)
        deadline = time.time() + CHIEF_WAIT_S
        while not _reachable(chief):  # The chief starts after us, or is restarting.
            if time.time() > deadline:
                raise UserError(f"The chief at {chief} did not come up within {CHIEF_WAIT_S:.0f} s.")
            time.sleep(1.0)
        while _reachable(chief):
            time.sleep(1.0)
        logging.info("[%s] the chief has finished; stopping.", info.label)
        return True


class ProgressSlots:
    """One progress counter per execution in flight, on the ps: a re-run applies only unclaimed steps.

    `acquire` sets a free slot to minus the execution's step count; each step
    adds one and applies only if the sum is still at most 0. A slot is free
    again once its execution has finished (its result fetched); an abandoned
    execution keeps its slot, since it may still be running.
    """

    def __init__(self, strategy: Any, size: int):
        with strategy.scope():
            self.variable = tf.Variable(tf.zeros([size], tf.int64), trainable=False, name="tfdist_progress")
        self.free = list(range(size))[::-1]

    def acquire(self, num_steps: int) -> int:
        if not self.free:
            raise RuntimeError("No free progress slot: more executions in flight than max_in_flight.")
        slot = self.free.pop()
        # Eager ops on the chief are synchronous here: the slot is set before the function is scheduled.
        with self._naming_the_ps():
            self.variable.scatter_update(tf.IndexedSlices(tf.constant([-num_steps], tf.int64), tf.constant([slot])))
        return slot

    def release(self, slot: int) -> int:
        """Frees the slot of a finished execution; returns how many claims its lost runs had made.

        A run that finishes claims every one of its steps, so the count above
        zero is what runs on workers that died had claimed (steps not applied again).
        """
        self.free.append(slot)
        with self._naming_the_ps():
            return int(self.variable.sparse_read([slot])[0])

    @contextlib.contextmanager
    def _naming_the_ps(self) -> Iterator[None]:
        """A lost ps fails the chief's own reads and writes with errors naming the chief; name the ps."""
        try:
            yield
        except tf.errors.UnavailableError as e:
            raise tf.errors.UnavailableError(None, None, f"The parameter server {self.variable.device} (progress "
                                                         f"slots) is unreachable: {e.message}") from e

    def on_ps(self) -> Any:
        """A device scope on the ps holding the slots (compiled): claims and their conds run there."""
        return tf.device(self.variable.device)

    def claim(self, slot: tf.Tensor) -> tf.Tensor:
        """Claims one step of the execution in `slot` (compiled); True where it is the step's to apply."""
        one = tf.IndexedSlices(tf.ones([1], tf.int64), tf.reshape(slot, [1]))
        return tf.gather(self.variable.scatter_add(one), slot) <= 0


def _staged(grads: Sequence[Any], variables: Sequence[Any]) -> list:
    """Each gradient copied to its variable's ps as soon as it is ready (compiled; None stays None).

    TensorFlow lowers a cond into Switch ops placed with their inputs: a gradient
    left on the worker would wait there for the claim's answer and only then
    travel. Staged on the ps, it travels while the claim is made, the updates
    (colocated with their variables) read it there, and only the claim's
    answer goes from the slots' ps to the others.
    """
    staged = list(grads)
    for i, (grad, variable) in enumerate(zip(grads, variables)):
        if grad is not None:
            with tf.device(tf_variable(variable).device):
                staged[i] = tf.nest.map_structure(tf.identity, grad, expand_composites=True)
    return staged


def _after(ready: Sequence[Any]) -> Any:
    """Control dependencies on a step's gradients (None entries and composite tensors allowed)."""
    return tf.control_dependencies(tf.nest.flatten([g for g in ready if g is not None], expand_composites=True))


class SlottedFunction:
    """A compiled execution whose scheduled runs each claim their steps from a progress slot.

    Called directly (evaluation on the chief) it runs without one; each
    `ParameterServerBackend.dispatch` passes the slot it acquired from `slots`
    (made at the first dispatch, so one per compiled function: a failed run's
    abandoned slots never reach the next run's).
    """

    def __init__(self, fn: Callable, backend: "ParameterServerBackend"):
        self.fn = fn
        self.backend = backend
        self.slots: ProgressSlots | None = None
        self.function = tf.function(self._execution)

    def _execution(self, *args: Any, slot: Any = None) -> Any:
        backend = self.backend
        backend._tracing = None if slot is None else (self.slots, slot)  # Read by `apply_step` while tracing.
        try:
            return self.fn(*args)
        finally:
            backend._tracing = None

    def __call__(self, *args: Any) -> Any:
        return self.function(*args)


class ParameterServerBackend(Backend):
    """The chief of a parameter-server job: coordinator and single controller."""

    def __init__(self, strategy: Any, info: ClusterInfo):
        super().__init__("parameter_server", strategy, "cpu", cluster=info, sharded_input=False,
                         max_in_flight=4 * len(info.cluster["worker"]), asynchronous=True,
                         description=f"ParameterServerStrategy: chief, {len(info.cluster['worker'])} worker(s), "
                                     f"{info.num_ps} ps task(s)")
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        self._in_flight: dict[int, tuple[Any, ProgressSlots, int]] = {}  # id(handle) -> (handle, slots, slot).
        self._tracing: tuple[ProgressSlots, tf.Tensor] | None = None  # Set while a scheduled execution is traced.

    @property
    def num_workers(self) -> int:
        return len(self.cluster.cluster["worker"])

    @property
    def single_controller(self) -> bool:
        return True

    def distribute_dataset(self, dataset_fn: Callable) -> Iterable:
        strategy = self.strategy
        return self.coordinator.create_per_worker_dataset(
            lambda: strategy.distribute_datasets_from_function(dataset_fn))

    def compile(self, fn: Callable) -> Callable:
        return SlottedFunction(fn, self)

    def apply_step(self, apply: Callable[[list], Any], counter: tf.Variable, ready: Sequence[Any] = (),
                   variables: Sequence[Any] = ()) -> None:
        tracing = self._tracing
        if tracing is None:  # Not a scheduled execution.
            return super().apply_step(apply, counter, ready, variables)
        slots, slot = tracing
        strategy = self.strategy
        if strategy.num_replicas_in_sync != 1:
            raise UserError(f"tfdist's parameter-server path runs one replica per worker; this strategy has "
                            f"{strategy.num_replicas_in_sync}. Give each worker one device (CUDA_VISIBLE_DEVICES).")

        staged = _staged(ready, variables)

        def step() -> None:
            # Inside a cond branch the strategy's own replica context refuses the optimizer's
            # merge_call (tf.distribute's mirrored_run); with one replica per worker the plain
            # replica context does what it would do: run the update in cross-replica context.
            with tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=0):
                apply(staged)
            counter.assign_add(1)

        # The claim waits for the gradients, arrived on their ps (`_staged`): nothing else orders it
        # after the step's input and forward pass, and once it is made the updates need nothing
        # more from the worker (a claim made while a worker still waits for its batch, or still
        # sends its gradients, is a step lost with that worker).
        with slots.on_ps(), _after(staged):
            tf.cond(slots.claim(slot), step, lambda: None)

    def claim(self, ready: Sequence[Any] = ()) -> Any:
        """A custom step's claim (made once, when its first gradients are ready), as `apply_step` claims."""
        tracing = self._tracing
        if tracing is None:
            return None
        slots, slot = tracing
        with slots.on_ps(), _after(ready):
            return slots.claim(slot)

    def when_claimed(self, claimed: Any, fn: Callable[[], Any]) -> None:
        if claimed is None:
            fn()
            return
        strategy = self.strategy

        def run() -> None:
            with tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=0):  # As in `apply_step`.
                fn()

        with tf.device(claimed.device):  # On the ps that claimed, as in `apply_step`.
            tf.cond(claimed, run, lambda: None)

    def dispatch(self, compiled: Callable, iterator: Any, num_steps: Any, *args: Any) -> Any:
        """Schedules a training execution of `num_steps` steps in a progress slot of its own."""
        if compiled.slots is None:
            compiled.slots = ProgressSlots(self.strategy, self.max_in_flight)
        slot = compiled.slots.acquire(int(num_steps))
        try:
            handle = self.coordinator.schedule(compiled.function, args=(iterator, num_steps, *args),
                                               kwargs={"slot": tf.constant(slot, tf.int32)})
        except BaseException:
            compiled.slots.free.append(slot)
            raise
        self._in_flight[id(handle)] = (handle, compiled.slots, slot)
        return handle

    def _finished(self, handle: Any) -> None:
        entry = self._in_flight.pop(id(handle), None)
        if entry is None:
            return
        skipped = entry[1].release(entry[2])
        if skipped > 0:
            logging.warning("An execution ran again after its worker was lost; the %d step(s) that worker had "
                            "claimed were not applied again.", skipped)

    def fetch(self, handle: Any) -> "np.ndarray | None":
        try:
            result = handle.fetch()
        except tf.errors.UnavailableError as e:
            return self._lost(handle, e)
        if result is None:
            # Every execution returns its totals, so no value means the function finished and its
            # result was then lost: TensorFlow's coordinator clears a finished RemoteValue when copying
            # it back fails, and a fetch already under way returns nothing rather than the error.
            return self._lost(handle, getattr(handle, "_get_error", lambda: None)())
        self._finished(handle)
        return np.asarray(result)

    def _lost(self, handle: Any, error: Optional[Exception]) -> None:
        """A finished execution whose result did not reach the chief: None, or `error` where it is fatal.

        The coordinator re-runs a function whose worker died before finishing it, so a failure here means
        the function finished and its result was lost with its worker before it could be copied: the steps
        happened, their loss/accuracy sums did not survive. A lost ps (or any other error) is a real failure.
        """
        text = "" if error is None else getattr(error, "message", None) or str(error)
        if error is not None and (not isinstance(error, tf.errors.UnavailableError) or "/job:ps/" in text
                                  or "/job:worker/" not in text):
            raise error
        logging.warning("A worker died holding the loss/accuracy of steps it had finished; those steps "
                        "count, their metrics are left out of this epoch's averages.")
        self._finished(handle)
        return None

    def abandon(self, handle: Any, wait: bool) -> None:
        """Scheduled functions finish on the workers; the chief does not wait for them (nor reuses their slots)."""
        self._in_flight.pop(id(handle), None)

    def distribute_eval_dataset(self, dataset_fn: Callable) -> Iterable:
        return dataset_fn(tf.distribute.InputContext())

    def run_eval(self, fn: Callable, args: Sequence[Any]) -> Any:
        return fn(*args)

    def reduce_eval(self, value: Any) -> tf.Tensor:
        return value

    def local_replica_values(self, variable: Any) -> list[np.ndarray]:
        return [np.asarray(tf_variable(variable))]

    def report_placement(self, variables: Sequence[Any]) -> None:
        counts: dict[str, int] = {}
        for variable in variables:
            value = tf_variable(variable)
            for part in getattr(value, "variables", [value]):  # A ShardedVariable has several.
                task = part.device.split("/device:")[0]
                counts[task] = counts.get(task, 0) + 1
        logging.info("Variables per parameter server: %s", ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))


def build(info: ClusterInfo, *, ps_shards: int | None) -> Backend:
    check_cluster(info, ps_shards=ps_shards)
    if info.task_type != "chief":
        return ServerTask(info)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({k: list(v) for k, v in info.cluster.items()}), task_type="chief", task_id=0,
        rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    # Read by tfdist.layers.ShardedEmbedding when it builds under this strategy (tables only: every other
    # variable stays whole, placed round-robin).
    strategy._tfdist_ps_shards = ps_shards
    return ParameterServerBackend(strategy, info)

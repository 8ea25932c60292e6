"""How much of MWMS's gradient all-reduce TensorFlow itself can hide behind the backward pass (no tfdist, no Keras).

A minimal TensorFlow program: plain ``tf.distribute.MultiWorkerMirroredStrategy``
(from TF_CONFIG), the MLP of scripts/comm_mlp.py (``--features`` -> ``--layers``
x ``--width`` -> ``--classes``, float32, plain tf.Variables, synthetic data,
SGD) and custom ``tf.function`` steps. In one run, on the same workers, it
times (median of ``--steps`` calls after ``--warmup``, the workers lined up by a
barrier before each mode) each of:

  forward       the forward pass and the loss;
  compute       forward, backward (tape.gradient) and the SGD update, no all-reduce: t_backward = compute - forward;
  comm          the all-reduce alone of the step's gradient-shaped tensors (one all_reduce call: t_comm);
  serial        gradients, one all-reduce of all of them after the whole backward, then the update;
  overlap       per-bucket all-reduces issued inside the backward: each bucket's weights pass through a
                tf.custom_gradient identity whose gradient function all-reduces the bucket's gradients, so the
                collective exists (and may run) as soon as those gradients do, last layer first;
  overlap_flow  the same buckets all-reduced one all_reduce call each, last layer first, after tape.gradient
                (the collectives wait for their inputs only: dataflow);
  overlap_pack  one all_reduce call of every gradient with CommunicationOptions(bytes_per_pack): MWMS reverses the
                list and all-reduces it pack by pack (what Keras' optimizer gets with a pack size set).

MWMS chains its collectives by an ordering token (CollectiveReduceV2 takes a
resource handle; automatic control dependencies run them in the order they
were created), so buckets are created last layer first. Buckets: one per layer
(--bucket_mb=0), or consecutive layers, last first, until one holds
--bucket_mb; overlap_pack packs by --bucket_mb (0: a pack per tensor).

Worker 0 prints one line ``OVERLAP {json}``: each time in ms (median, min,
max), bound = t_forward + max(t_backward, t_comm), overlap/serial, bound/overlap
and the threads seen (OMP_NUM_THREADS, TF_NUM_INTRAOP/INTEROP_THREADS -- tfdist-launch may set them per task --
and --intra_op/--inter_op, which win over the variables). With --profile_dir it
also traces --profile_steps steps of --profile_mode on worker 0 (open the
directory in TensorBoard's profile plugin, trace viewer: CollectiveReduceV2 against the MatMuls) and adds
the trace's summary: per step, when each collective ran against the backward's last MatMul.

  python -m tfdist.cli.launch --num_workers=2 --link_rate=1gbit -- python scripts/overlap_probe.py
  OMP_NUM_THREADS=1 python -m tfdist.cli.launch --num_workers=2 --link_rate=1gbit -- \\
      python scripts/overlap_probe.py --intra_op=1 --inter_op=2 --profile_dir=/tmp/overlap
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time
from typing import Callable, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

MODES = ("forward", "compute", "comm", "serial", "overlap", "overlap_flow", "overlap_pack")
MIB = 2 ** 20
STEP_EVENT = "probe_step"  # The TraceMe around each traced call.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")  # tfdist-launch sets them.
SUM = tf.distribute.ReduceOp.SUM


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3, help="Hidden layers.")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch", type=int, default=1024, help="Global batch.")
    parser.add_argument("--learning_rate", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=20, help="Timed calls per mode.")
    parser.add_argument("--warmup", type=int, default=3, help="Untimed calls per mode first (tracing included).")
    parser.add_argument("--bucket_mb", type=float, default=0.0,
                        help="0: one bucket per layer (overlap_pack: a pack per tensor); else MiB per bucket/pack.")
    parser.add_argument("--mode", default="all", help=f"all, or comma-separated of {', '.join(MODES)}.")
    parser.add_argument("--profile_dir", default=None, help="Trace --profile_steps steps on worker 0 into DIR.")
    parser.add_argument("--profile_mode", default="overlap", choices=MODES)
    parser.add_argument("--profile_steps", type=int, default=3)
    parser.add_argument("--intra_op", type=int, default=0, help="tf.config.threading intra-op threads (0: TF's).")
    parser.add_argument("--inter_op", type=int, default=0, help="tf.config.threading inter-op threads (0: TF's).")
    args = parser.parse_args(argv)
    modes = MODES if args.mode == "all" else tuple(m.strip() for m in args.mode.split(","))
    if set(modes) - set(MODES):
        parser.error(f"--mode: unknown {sorted(set(modes) - set(MODES))}; valid: all, {', '.join(MODES)}")
    args.modes = modes
    return args


def worker_index() -> int:
    return int(json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {}).get("index", 0))


def is_chief() -> bool:
    task = json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {})
    return task.get("type", "worker") in ("worker", "chief") and int(task.get("index", 0)) == 0


class Mlp:
    """The MLP's weights as plain tf.Variables (the same on every worker: seeded), and its buckets."""

    def __init__(self, features: int, width: int, layers: int, classes: int, bucket_mb: float = 0.0):
        sizes = [features] + [width] * layers + [classes]
        rng = np.random.default_rng(0)
        self.params: list[tuple[tf.Variable, tf.Variable]] = []
        for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
            limit = np.sqrt(6.0 / (n_in + n_out))
            kernel = rng.uniform(-limit, limit, (n_in, n_out)).astype(np.float32)
            self.params.append((tf.Variable(kernel, name=f"kernel{i}"),
                                tf.Variable(np.zeros(n_out, np.float32), name=f"bias{i}")))
        self.variables = [v for pair in self.params for v in pair]
        self.buckets = layer_buckets([sum(v.shape.num_elements() * 4 for v in p) for p in self.params], bucket_mb)

    def logits(self, x: tf.Tensor, hook: Optional[Callable[[list], list]] = None) -> tf.Tensor:
        """The forward pass; with `hook`, each bucket's weights pass through hook (a custom-gradient identity)."""
        values = [[tf.convert_to_tensor(v) for v in pair] for pair in self.params]
        if hook is not None:
            for bucket in self.buckets:
                flat = hook([t for i in bucket for t in values[i]])
                for j, i in enumerate(bucket):
                    values[i] = flat[2 * j:2 * j + 2]
        h = x
        for i, (kernel, bias) in enumerate(values):
            h = tf.matmul(h, kernel) + bias
            if i < len(values) - 1:
                h = tf.nn.relu(h)
        return h

    def bucket_indices(self) -> list[list[int]]:
        """Indices into the flat variable list, bucket by bucket (last layer first)."""
        return [[2 * i + k for i in bucket for k in (0, 1)] for bucket in self.buckets]


def layer_buckets(layer_bytes: Sequence[int], bucket_mb: float) -> list[list[int]]:
    """Layers grouped last first: one per layer (bucket_mb 0), or until a bucket holds bucket_mb MiB."""
    buckets: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(layer_bytes))):
        if buckets[-1] and size >= bucket_mb * MIB:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += layer_bytes[i]
    return buckets


def reduce_hook(reduce: Callable[[list], list]) -> Callable[[list], list]:
    """An identity whose gradient function all-reduces the incoming gradients (one call for the whole list)."""

    @tf.custom_gradient
    def hook(*xs):
        def grad(*dys):
            return reduce(list(dys))
        return [tf.identity(x) for x in xs], grad

    return lambda tensors: list(hook(*tensors))


def make_steps(strategy: tf.distribute.Strategy, mlp: Mlp, x: tf.Tensor, y: tf.Tensor, global_batch: int,
               learning_rate: float, bucket_mb: float) -> dict[str, Callable[[], tf.Tensor]]:
    """One tf.function per mode, each running one step of it on every worker through strategy.run."""

    def all_reduce(tensors: list, options=None) -> list:
        return tf.distribute.get_replica_context().all_reduce(SUM, tensors, options=options)

    def loss_of(logits: tf.Tensor) -> tf.Tensor:
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        return tf.reduce_sum(ce) / global_batch

    def gradients(hook=None) -> tuple[tf.Tensor, list]:
        with tf.GradientTape() as tape:
            loss = loss_of(mlp.logits(x, hook))
        return loss, tape.gradient(loss, mlp.variables)

    def apply(loss: tf.Tensor, grads: Sequence[tf.Tensor]) -> tf.Tensor:
        updates = [v.assign_sub(learning_rate * g) for v, g in zip(mlp.variables, grads)]
        with tf.control_dependencies(updates):
            return tf.identity(loss)

    def flow(grads: list) -> list:
        out = list(grads)
        for indices in mlp.bucket_indices():  # Last layer first: the order the ordering token runs them in.
            for i, g in zip(indices, all_reduce([grads[i] for i in indices])):
                out[i] = g
        return out

    pack = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=int(bucket_mb * MIB) or 1)

    def then_reduce(reduce: Callable[[list], list]) -> Callable[[], tf.Tensor]:
        def step() -> tf.Tensor:
            loss, grads = gradients()
            return apply(loss, reduce(grads))
        return step

    replica_fns = {
        "forward": lambda: loss_of(mlp.logits(x)),
        "compute": lambda: apply(*gradients()),
        "comm": lambda: comm_only(all_reduce, mlp.variables),
        "serial": then_reduce(all_reduce),
        "overlap": lambda: apply(*gradients(reduce_hook(all_reduce))),
        "overlap_flow": then_reduce(flow),
        "overlap_pack": then_reduce(lambda grads: all_reduce(grads, pack)),
    }
    return {mode: tf.function(lambda fn=fn: strategy.run(fn), autograph=False) for mode, fn in replica_fns.items()}


def comm_only(all_reduce: Callable[[list], list], variables: Sequence[tf.Variable]) -> tf.Tensor:
    """One all_reduce call of tensors shaped as the gradients (the weights' values), nothing else."""
    reduced = all_reduce([tf.identity(v) for v in variables])  # Identity: placed on the replica's device.
    with tf.control_dependencies(reduced):
        return tf.constant(0.0)


def barrier(strategy: tf.distribute.Strategy) -> Callable[[], None]:
    """Returns a call that waits until every worker reaches it (a one-element all-reduce)."""
    fn = tf.function(lambda: strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(SUM, 1.0)),
                     autograph=False)

    def wait() -> None:
        local(strategy, fn()).numpy()

    return wait


def local(strategy: tf.distribute.Strategy, value) -> tf.Tensor:
    return strategy.experimental_local_results(value)[0]


def time_calls(strategy: tf.distribute.Strategy, fn: Callable[[], tf.Tensor], steps: int, warmup: int,
               wait: Callable[[], None]) -> list[float]:
    """Milliseconds of each of `steps` calls of fn after `warmup` untimed ones, both workers starting together."""
    for _ in range(warmup):
        local(strategy, fn()).numpy()
    wait()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        local(strategy, fn()).numpy()
        times.append(1000 * (time.perf_counter() - start))
    return times


def bound(medians: dict[str, float]) -> dict[str, float]:
    """t_forward, t_backward, t_comm and bound = t_forward + max(t_backward, t_comm), from the modes' medians."""
    t_forward, t_comm = medians["forward"], medians["comm"]
    t_backward = max(0.0, medians["compute"] - t_forward)
    return {"t_forward_ms": round(t_forward, 2), "t_backward_ms": round(t_backward, 2), "t_comm_ms": round(t_comm, 2),
            "bound_ms": round(t_forward + max(t_backward, t_comm), 2)}


def measure(strategy: tf.distribute.Strategy, features: int, width: int, layers: int, classes: int,
            global_batch: int, modes: Sequence[str] = ("forward", "compute", "comm"), steps: int = 10,
            warmup: int = 2, learning_rate: float = 0.01, bucket_mb: float = 0.0,
            profile: Optional[tuple[str, str, int]] = None) -> dict:
    """Times `modes` on this strategy's workers (every worker must call it alike); returns medians, min/max."""
    with tf.device("/cpu:0"):
        per_replica = global_batch // strategy.num_replicas_in_sync
        rng = np.random.default_rng(1 + worker_index())
        x = tf.constant(rng.standard_normal((per_replica, features), dtype=np.float32))
        y = tf.constant(rng.integers(0, classes, size=(per_replica,)).astype(np.int32))
        mlp = Mlp(features, width, layers, classes, bucket_mb)
    steps_fns = make_steps(strategy, mlp, x, y, global_batch, learning_rate, bucket_mb)
    wait = barrier(strategy)
    times = {mode: time_calls(strategy, steps_fns[mode], steps, warmup, wait) for mode in modes}
    result: dict = {"modes": {m: {"median": round(statistics.median(t), 2), "min": round(min(t), 2),
                                  "max": round(max(t), 2)} for m, t in times.items()},
                    "buckets": mlp.buckets, "gradient_bytes": sum(v.shape.num_elements() * 4 for v in mlp.variables)}
    medians = {m: statistics.median(t) for m, t in times.items()}
    if {"forward", "compute", "comm"} <= set(medians):
        result.update(bound(medians))
    if profile is not None:
        result["profile"] = trace(strategy, steps_fns[profile[1]], *profile[::2], wait)
    return result


def trace(strategy: tf.distribute.Strategy, fn: Callable[[], tf.Tensor], directory: str, steps: int,
          wait: Callable[[], None]) -> dict:
    """Traces `steps` calls on worker 0 (the others run them untraced); summarises the trace."""
    wait()
    if is_chief():
        tf.profiler.experimental.start(directory)
    for i in range(steps):
        with tf.profiler.experimental.Trace(STEP_EVENT, step_num=i, _r=1):
            local(strategy, fn()).numpy()
    if not is_chief():
        return {}
    tf.profiler.experimental.stop()
    return summarise_trace(directory)


def summarise_trace(directory: str) -> dict:
    """The newest .xplane.pb under `directory`, step by step (see trace_steps)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not paths:
        return {"trace": None}
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as f:
        space.ParseFromString(f.read())
    events = []  # (start_ns, end_ns, kind)
    for plane in space.planes:
        names = {k: m.display_name or m.name for k, m in plane.event_metadata.items()}
        for line in plane.lines:
            for e in line.events:
                name = names.get(e.metadata_id, "")
                kind = ("step" if name.startswith(STEP_EVENT) else "collective" if name == "CollectiveReduceV2"
                        else "matmul" if name.endswith("MatMul") else None)  # _MklMatMul, _MklNativeFusedMatMul.
                if kind and e.duration_ps > 0:
                    start = line.timestamp_ns + e.offset_ps // 1000
                    events.append((start, start + e.duration_ps // 1000, kind))
    return {"trace": paths[-1], "steps": trace_steps(sorted(set(events)))}


def trace_steps(events: list[tuple[int, int, str]]) -> list[dict]:
    """Each traced step's collectives ([start, end] in ms from the step's start) against the end of its last
    MatMul (the backward's last), how many started before it, and the collective time before and after it."""
    out = []
    for step_start, step_end, _ in (e for e in events if e[2] == "step"):
        inside = [e for e in events if e[2] != "step" and step_start <= e[0] < step_end]
        matmuls = [e for e in inside if e[2] == "matmul"]
        collectives = [(s, e) for s, e, kind in inside if kind == "collective"]
        if not matmuls:
            continue
        last = max(e for _, e, _ in matmuls)
        ms = lambda t: round((t - step_start) / 1e6, 2)  # noqa: E731
        out.append({"step_ms": ms(step_end), "last_matmul_end_ms": ms(last),
                    "collectives_ms": [[ms(s), ms(e)] for s, e in collectives],
                    "started_before_last_matmul_end": sum(s < last for s, _ in collectives),
                    "collective_ms_before_it": round(sum(max(0, min(e, last) - s) for s, e in collectives) / 1e6, 2),
                    "collective_ms_after_it": round(sum(e - max(s, last) for s, e in collectives if e > last) / 1e6,
                                                    2)})
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op)  # Before anything runs.
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    profile = (args.profile_dir, args.profile_mode, args.profile_steps) if args.profile_dir else None
    result = measure(strategy, args.features, args.width, args.layers, args.classes, args.batch, args.modes,
                     args.steps, args.warmup, args.learning_rate, args.bucket_mb, profile)
    if not is_chief():
        return
    medians = {m: v["median"] for m, v in result["modes"].items()}
    for mode in ("overlap", "overlap_flow", "overlap_pack"):
        if mode in medians and "serial" in medians:
            result[f"{mode}_over_serial"] = round(medians[mode] / medians["serial"], 3)
        if mode in medians and "bound_ms" in result:
            result[f"bound_over_{mode}"] = round(result["bound_ms"] / medians[mode], 3)
    result.update(workers=strategy.num_replicas_in_sync, global_batch=args.batch, steps=args.steps,
                  warmup=args.warmup, bucket_mb=args.bucket_mb, tensorflow=tf.__version__,
                  threads={**{k: os.environ.get(k) for k in THREAD_VARIABLES},
                           "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
                           "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
                           "cpu_count": os.cpu_count()})
    print("OVERLAP " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""tfdist-train: parse flags, build one frozen TrainConfig, call the library.

Kept short on purpose: all logic lives in `tfdist.mnist.train` and the modules it
uses, which never read FLAGS.

  tfdist-train --strategy=mirrored --num_cpu_replicas=2 --workdir=runs/m2
  tfdist-train --flagfile=configs/mirrored.flags --epochs=3
"""

from __future__ import annotations

import os
import traceback

from tfdist.cli import common

common.quiet_tensorflow()

from absl import app, flags, logging  # noqa: E402

from tfdist.distribute import strategies  # noqa: E402
from tfdist.distribute.options import PRECISIONS  # noqa: E402
from tfdist.mnist.config import LR_SCALINGS, LR_SCHEDULES, OPTIMIZERS, TrainConfig  # noqa: E402
from tfdist.errors import UserError  # noqa: E402

FLAGS = flags.FLAGS
_D = TrainConfig()

# Backend.
flags.DEFINE_string("strategy", _D.strategy, f"One of: {', '.join(strategies.strategy_names())}.")
flags.DEFINE_integer("num_gpus", None, "GPUs for --strategy=mirrored (default: all).")
flags.DEFINE_integer("num_cpu_replicas", None, "Split the CPU into N logical devices for --strategy=mirrored.")
flags.DEFINE_string("all_reduce", _D.all_reduce, "Cross-device all-reduce: mirrored: auto|nccl|hierarchical_copy|"
                    "reduce_to_one; multi_worker_mirrored: auto|ring|nccl.")
flags.DEFINE_enum("all_reduce_dtype", _D.all_reduce_dtype, ["float32", "bfloat16"], "The dtype gradients travel "
                  "in during the all-reduce (bfloat16 halves the bytes; every synchronous backend).")
flags.DEFINE_float("all_reduce_pack_mb", _D.all_reduce_pack_mb, "multi_worker_mirrored: pack gradients into "
                   "all-reduces of this many MB, last layers first, so the all-reduce starts while the backward pass "
                   "runs (default: an eighth of a step's gradient bytes, within 4-64 MB; 0: one all-reduce after "
                   "it, TensorFlow's default).")
flags.DEFINE_float("collective_timeout_s", _D.collective_timeout_s,
                   "Seconds before a multi-worker collective gives up on a lost peer (0: no timeout).")
flags.DEFINE_string("tpu", None, "TPU for --strategy=tpu: 'local', a TPU name or grpc://host:port.")
flags.DEFINE_string("tpu_zone", None, "GCE zone of the TPU (--strategy=tpu).")
flags.DEFINE_string("gcp_project", None, "GCP project of the TPU (--strategy=tpu).")
flags.DEFINE_string("hvd_compression", None, "Horovod gradient compression: none|fp16.")
flags.DEFINE_string("hvd_op", None, "Horovod reduction: average|adasum.")
flags.DEFINE_integer("ps_shards", None, "--strategy=parameter_server: row shards per tfdist.layers.ShardedEmbedding "
                     "table (default: one per ps task); other variables stay whole, round-robin over the ps tasks.")
# Data.
flags.DEFINE_string("dataset", _D.dataset, "mnist (bundled) | synthetic | idx:DIR | tfds:NAME.")
flags.DEFINE_string("data_dir", None, "tensorflow-datasets data directory (tfds:NAME).")
flags.DEFINE_boolean("download", _D.download, "Let tensorflow-datasets download (tfds:NAME).")
# Optimisation.
flags.DEFINE_integer("epochs", _D.epochs, "Training epochs.")
flags.DEFINE_integer("global_batch_size", None, "Examples per optimizer step over all replicas (default 128).")
flags.DEFINE_integer("per_replica_batch_size", None, "Examples per replica per forward pass (instead of "
                     "--global_batch_size).")
flags.DEFINE_enum("optimizer", _D.optimizer, OPTIMIZERS, "adam, or plain sgd (no momentum: any error in gradient "
                  "scaling shows in the weights).")
flags.DEFINE_float("learning_rate", _D.learning_rate, "Peak learning rate before replica scaling.")
flags.DEFINE_enum("lr_scaling", _D.lr_scaling, LR_SCALINGS, "Scale the learning rate with the replica count.")
flags.DEFINE_float("warmup_epochs", _D.warmup_epochs, "Linear learning-rate warm-up, in epochs.")
flags.DEFINE_enum("lr_schedule", _D.lr_schedule, LR_SCHEDULES, "After warm-up: cosine decay to 0 by the last "
                  "epoch, or constant.")
flags.DEFINE_integer("grad_accum_steps", _D.grad_accum_steps, "Micro-batches accumulated per optimizer step.")
flags.DEFINE_integer("zero_stage", _D.zero_stage, "Shard the optimizer state over the replicas (1), the "
                     "gradients too (2), the weights too (3), as DeepSpeed's ZeRO stages; 0: every replica holds "
                     "them whole (docs/sharding.md).")
flags.DEFINE_integer("steps_per_execution", None, "Steps per compiled execution (default 10; 100 on TPU).")
flags.DEFINE_string("precision", _D.precision, f"One of: {', '.join(PRECISIONS)}.")
flags.DEFINE_enum("jit_compile", _D.jit_compile, ["auto", "true", "false"], "XLA for each compiled step: auto is "
                  "what Keras resolves for the model (on for one GPU with the default strategy), off on CPUs and "
                  "TPUs (TPUStrategy compiles with XLA itself).")
flags.DEFINE_integer("seed", _D.seed, "Seed for weights and data order.")
# Run directory.
flags.DEFINE_string("workdir", None, "Run directory (default: a new one under ./runs/).")
flags.DEFINE_boolean("resume", None, "Resume from the workdir's checkpoint (default: when one exists).")
flags.DEFINE_integer("checkpoint_every_steps", _D.checkpoint_every_steps,
                     "Also checkpoint every N steps (0: at epoch ends only).")
flags.DEFINE_float("checkpoint_every_secs", _D.checkpoint_every_secs,
                   "Also checkpoint about every S seconds (the chief's step time, measured at the start, turns S "
                   "into a step interval every task shares; 0: off).")
flags.DEFINE_integer("keep_checkpoints", _D.keep_checkpoints, "Checkpoints to keep.")
flags.DEFINE_integer("max_steps", None, "Stop after this many steps in total.")
flags.DEFINE_integer("summary_every_steps", _D.summary_every_steps, "Write train scalars every N steps "
                     "(0: after every execution).")
flags.DEFINE_string("export", _D.export, "What the chief exports at the end: keras (WORKDIR/model.keras), "
                    "saved_model (WORKDIR/saved_model/, for TF Serving), or both: keras,saved_model.")
flags.DEFINE_boolean("stop_on_nonfinite", _D.stop_on_nonfinite, "Stop with an error at a step whose loss (or "
                     "gradient) is NaN or inf; --nostop_on_nonfinite trains on, as Keras' fit does.")
flags.DEFINE_string("profile_steps", None, "START,END: write a TensorFlow profiler trace of these steps to "
                    "WORKDIR/tensorboard (chief only).")


def config_from_flags() -> TrainConfig:
    fields = TrainConfig.__dataclass_fields__
    return TrainConfig(**{name: FLAGS[name].value for name in fields})


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise UserError(f"Unexpected arguments {argv[1:]}; tfdist-train takes only --flags.")
    logging.set_verbosity(logging.INFO)
    from tfdist.mnist import train  # Imported late: pulls in TensorFlow.

    import tensorflow as tf

    config = config_from_flags().validate()
    try:
        metrics = train.train_and_evaluate(config)
    except train.Preempted as e:
        logging.warning("%s", e)
        return 143
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.CancelledError,
            tf.errors.AbortedError) as e:
        # A lost peer surfaces as one of these in every surviving task: say so in one paragraph.
        if os.environ.get("TFDIST_TRACEBACK"):
            traceback.print_exc()
        common.fail("tfdist-train", f"{describe_lost_peer(e)} A worker or parameter server probably died or "
                    "became unreachable; its own log says why (TFDIST_TRACEBACK=1 shows where this task saw it). "
                    "Relaunch with the same --workdir to resume from the last checkpoint.", 1)
    if metrics.get("served"):
        print(f"[{metrics['task']}] served until the chief finished", flush=True)
        return 0
    print(
        f"[{metrics['task']}] done: steps={metrics['steps']} eval_accuracy={metrics['eval_accuracy']:.4f} "
        f"workdir={metrics['workdir']} weights_fingerprint={metrics['weights_fingerprint']}",
        flush=True,
    )
    return 0


def describe_lost_peer(error: Exception) -> str:
    """Names the task a TensorFlow runtime error lost contact with, when it says."""
    import re

    text = getattr(error, "message", "") or str(error)
    # A worker that could not reach a lost ps names itself first: the ps is the one lost.
    task = re.search(r"(/job:ps/replica:\d+/task:\d+)", text) or re.search(r"(/job:[a-z]+/replica:\d+/task:\d+)", text)
    detail = next((line.strip() for line in text.splitlines() if "grpc_message" in line or "Socket closed" in line
                   or "failed to connect" in line.lower()), text.strip().splitlines()[0] if text.strip() else "")
    where = f"task {task.group(1)}" if task else "another task of the job"
    return f"lost contact with {where} ({type(error).__name__}: {detail[:300]})."


def _main(argv: list[str]) -> int | None:
    return common.run_reporting_user_errors("tfdist-train", lambda: main(argv))


def run() -> None:
    try:
        app.run(_main)
    except flags.Error as e:  # Bad flag syntax before main().
        common.fail("tfdist-train", str(e))


if __name__ == "__main__":
    run()

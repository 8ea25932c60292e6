"""The sync_batchnorm benchmark: what `tfdist.fit(sync_batchnorm=True)` costs, in training steps per second.

One process of 2 CPU replicas (MirroredStrategy) trains a CNN with two BatchNormalization layers (Conv 32 ->
BN -> Conv 64 -> BN -> Dense 10) on the bundled digits, float32, SGD, for 3 epochs of STEPS (100) steps, with and
without the option, at a global batch of 16 (8 a replica: the regime the option is for) and 128. Each run is a
process of its own; the two sides alternate (off, on, off, on, ...) so drift on a shared machine hits both;
steps/s (wall clock) and process CPU milliseconds a step (less moved by other work on a shared machine) are
taken over epochs 2-3 (the first pays for tracing), and each row's ratios between the medians.

  python scripts/sync_batchnorm_cost.py                   # writes benchmarks/sync_batchnorm.json, prints a table
  python scripts/sync_batchnorm_cost.py --repeats=1 --batches=16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, EPOCHS = 100, 3


def worker(batch: int, synced: bool) -> None:
    """One run: prints one JSON line of its figures."""
    import keras

    import tfdist
    from tfdist.mnist import data
    from tfdist.training.fitting import train

    Clock = _clock()
    digits = data.load_dataset("mnist")
    x = digits.train_images[:batch * STEPS].astype("float32") / 255.0
    y = digits.train_labels[:batch * STEPS]
    keras.utils.set_random_seed(0)
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32")
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.BatchNormalization(), keras.layers.MaxPooling2D(), keras.layers.Conv2D(64, 3),
            keras.layers.BatchNormalization(), keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    clock = Clock()
    train(model, x, y, batch_size=batch, epochs=EPOCHS, verbose=0, sync_batchnorm=synced, export=(),
          callbacks=[clock])
    (wall_0, cpu_0), (wall_1, cpu_1) = clock.ends[0], clock.ends[-1]
    steps = STEPS * (EPOCHS - 1)
    print("SYNCBN " + json.dumps({"batch": batch, "sync_batchnorm": synced,
                                  "steps_per_s": round(steps / (wall_1 - wall_0), 2),
                                  "cpu_ms_per_step": round(1000 * (cpu_1 - cpu_0) / steps, 2)}), flush=True)


def _clock() -> type:
    import keras

    class Clock(keras.callbacks.Callback):
        """Wall and process CPU time at each epoch's end (no batch hooks: steps_per_execution stays 10)."""

        def __init__(self) -> None:
            super().__init__()
            self.ends: list[tuple[float, float]] = []

        def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
            self.ends.append((time.perf_counter(), time.process_time()))

    return Clock


def run(batch: int, synced: bool) -> dict:
    command = [sys.executable, os.path.abspath(__file__), f"--worker={batch},{int(synced)}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=REPO,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    lines = [line[len("SYNCBN "):] for line in done.stdout.splitlines() if line.startswith("SYNCBN ")]
    if not lines:
        raise SystemExit(f"batch {batch}, sync_batchnorm={synced}: no figures (exit {done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    return json.loads(lines[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batches", default="16,128", help="Global batch sizes, comma-separated.")
    parser.add_argument("--repeats", type=int, default=5, help="Alternating rounds of off, on.")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "sync_batchnorm.json"))
    args = parser.parse_args()
    if args.worker is not None:
        batch, synced = args.worker.split(",")
        worker(int(batch), bool(int(synced)))
        return
    started, runs, summary = time.time(), [], []
    for batch in (int(b) for b in args.batches.split(",")):
        for _ in range(args.repeats):
            for synced in (False, True):
                runs.append(run(batch, synced))
                print(runs[-1], flush=True)
        off, on = ({key: statistics.median(r[key] for r in runs if r["batch"] == batch
                                           and r["sync_batchnorm"] is synced)
                    for key in ("steps_per_s", "cpu_ms_per_step")} for synced in (False, True))
        summary.append({"batch": batch, "per_replica": batch // 2, "steps_per_s_off": off["steps_per_s"],
                        "steps_per_s_on": on["steps_per_s"],
                        "on_vs_off": round(on["steps_per_s"] / off["steps_per_s"], 3),
                        "cpu_ms_per_step_off": off["cpu_ms_per_step"], "cpu_ms_per_step_on": on["cpu_ms_per_step"],
                        "cpu_on_vs_off": round(on["cpu_ms_per_step"] / off["cpu_ms_per_step"], 3)})
    out = {"machine": os.uname().nodename, "cores": os.cpu_count(), "replicas": 2, "steps_per_epoch": STEPS,
           "epochs_timed": EPOCHS - 1, "runs": runs, "summary": summary, "seconds": round(time.time() - started),
           "measured": time.strftime("%Y-%m-%d", time.gmtime())}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("| global batch (per replica) | steps/s off | steps/s on | on / off | CPU ms/step off | on | on / off |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s in summary:
        print(f"| {s['batch']} ({s['per_replica']}) | {s['steps_per_s_off']} | {s['steps_per_s_on']} | "
              f"{s['on_vs_off']} | {s['cpu_ms_per_step_off']} | {s['cpu_ms_per_step_on']} | {s['cpu_on_vs_off']} |")


if __name__ == "__main__":
    main()

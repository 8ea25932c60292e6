"""What pacing the reduce-scatters saves (`tfdist/training/zero/pacing.py`): one process of 2 CPU replicas
(MirroredStrategy's collective ops; one allocator for both), Adam, global batch 64, 2 epochs of 5 steps, at
zero_stage 1 and 2, with and without ``grad_accum_steps=2``, each bucket's gradient held back for the next
bucket's reduce-scatter (``pacing.SLACK=1``, tfdist's default) or not (0), each run in a fresh process.

Reports TensorFlow's allocator peak over the fit (`get_memory_info("CPU:0")`, the model's own weights and
both replicas included) and the second epoch's time. Two MLPs: 4 x 4096 (three 64 MiB kernels, each a bucket
with its bias another: pacing's worst case, two kernels in flight are two thirds of the gradient) and 8 x 2048
(7 buckets of 16 MiB).

  python scripts/zero_pacing.py        # writes benchmarks/zero_pacing.json and prints a table
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, STEPS = 64, 5
MODELS = ((4, 4096), (8, 2048))


def worker(depth: int, width: int, stage: int, accum: int, slack: int) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.training.fitting import train
    from tfdist.training.zero import pacing

    pacing.SLACK = slack
    strategy = tfdist.make_strategy("mirrored", num_cpu_replicas=2, precision="float32")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(BATCH * STEPS, width)).astype("float32"), rng.integers(0, 10, size=BATCH * STEPS)
    with strategy.scope():
        model = keras.Sequential([keras.Input((width,))] +
                                 [keras.layers.Dense(width, activation="relu") for _ in range(depth - 1)] +
                                 [keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(1e-4),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    result = train(model, x, y, batch_size=BATCH, epochs=2, verbose=0, zero_stage=stage, steps_per_execution=STEPS,
                   export=(), shuffle=False, grad_accum_steps=accum)
    info = tf.config.experimental.get_memory_info("CPU:0")
    print("PACING " + json.dumps({
        "model": f"{depth} x {width}", "stage": stage, "grad_accum_steps": accum, "slack": slack,
        "allocator_peak_mib": round(info["peak"] / 2 ** 20), "epoch2_s": round(result.epoch_seconds[-1], 3),
        "weights_sum": float(sum(np.abs(w).astype(np.float64).sum() for w in model.get_weights()))}), flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*(int(a) for a in sys.argv[2:7]))
        return
    rows = []
    for (depth, width), accum, stage, slack in itertools.product(MODELS, (2, 1), (1, 2), (0, 1)):
        out = subprocess.run([sys.executable, __file__, "--worker", str(depth), str(width), str(stage), str(accum),
                              str(slack)], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
        row = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("PACING "))[7:])
        rows.append(row)
        print(row, flush=True)
    with open(os.path.join(REPO, "benchmarks", "zero_pacing.json"), "w") as f:
        json.dump({"machine": "vm", "cores": 2, "replicas": 2, "batch": BATCH, "runs": rows}, f, indent=1)
    print("| model | accum | stage | allocator peak MiB, unpaced / paced | epoch 2 s, unpaced / paced |\n"
          "| --- | --- | --- | --- | --- |")
    for (depth, width), accum, stage in itertools.product(MODELS, (2, 1), (1, 2)):
        pair = [r for r in rows if r["model"] == f"{depth} x {width}" and r["grad_accum_steps"] == accum
                and r["stage"] == stage]
        by = {r["slack"]: r for r in pair}
        print(f"| {depth} x {width} | {accum} | {stage} | {by[0]['allocator_peak_mib']} / {by[1]['allocator_peak_mib']} "
              f"| {by[0]['epoch2_s']} / {by[1]['epoch2_s']} |")


if __name__ == "__main__":
    main()

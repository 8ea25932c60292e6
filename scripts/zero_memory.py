"""The zero_memory benchmark: what sharding the optimizer state (`zero_stage`) saves and costs, measured.

2 MultiWorkerMirrored workers (tfdist-launch) on this machine train a 4 x 4096 MLP (50.4M float32 weights,
201 MB; Adam's moments 403 MB) for 2 epochs of 10 steps, global batch 64, at zero_stage 0, 1 and 2 (issue 41's
protocol) and 3, over loopback and
over a link shaped to 1 Gbit/s (--link_rate=1gbit). Each worker reports its peak resident memory
(ru_maxrss), TensorFlow's allocator peak (`get_memory_info("CPU:0")`), the optimizer-state bytes it holds
(`LoopResult.optimizer_state`) and the second epoch's time (the first pays for tracing). What a stage takes off
a worker: stage 1 half of Adam's moments, stage 2 also half of the gradient, stage 3 also half of the weights.

"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTS_MB = (3 * (4096 * 4096 + 4096) + 4096 * 10 + 10) * 4 / 2 ** 20  # Every float32 weight (and its gradient).
WIDTH, DEPTH, BATCH, STEPS = 4096, 4, 64, 10
STAGES = (0, 1, 2, 3)


def worker(stage: int, accum: int = 1) -> None:
    """One worker: trains and prints one JSON line of its figures."""
    import resource

    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.distribute import strategies
    from tfdist.training.fitting import train

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(BATCH * STEPS, WIDTH)).astype("float32"), rng.integers(0, 10, size=BATCH * STEPS)
    strategy = tfdist.make_strategy(precision="float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((WIDTH,))] +
                                 [keras.layers.Dense(WIDTH, activation="relu") for _ in range(DEPTH - 1)] +
                                 [keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(1e-4),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    class StepPeak(keras.callbacks.Callback):
        """The allocator's peak over the second epoch alone (steps, not set-up)."""
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                tf.config.experimental.reset_memory_stats("CPU:0")
                self.base = tf.config.experimental.get_memory_info("CPU:0")["current"]

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                info = tf.config.experimental.get_memory_info("CPU:0")
                self.figures = {"step_peak_mib": round(info["peak"] / 2 ** 20),
                                "step_peak_over_start_mib": round((info["peak"] - self.base) / 2 ** 20)}

    peak = StepPeak()
    # Stage 3 without the callback: its hooks would have the weights gathered whole for them (`zero.stage3`),
    # which the peaks would then count; its figures are the whole run's.
    result = train(model, x, y, batch_size=BATCH, epochs=2, verbose=0, zero_stage=stage, steps_per_execution=STEPS,
                   grad_accum_steps=accum,
                   export=(), callbacks=[peak] if stage < 3 else [])
    if stage >= 3:
        peak.figures = {"step_peak_mib": round(tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2 ** 20)}
    backend = strategies.current_backend()
    mine = result.optimizer_state.get("optimizer_state_bytes_per_replica", [None] * backend.num_replicas)
    state = mine[backend.worker_index] if stage else sum(
        int(np.prod(v.shape)) * 4 * 2 for v in model.trainable_variables)  # Unsharded: Adam's two moments.
    print("ZERO " + json.dumps({
        "stage": stage, "worker": backend.worker_index, "params": model.count_params(),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "allocator_peak_mib": round(tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2 ** 20),
        **peak.figures, "optimizer_state_mb": round(state / 2 ** 20, 1), "epoch2_s": round(result.epoch_seconds[-1], 3),
        "step_ms": round(1000 * result.epoch_seconds[-1] / STEPS, 1)}), flush=True)


def launch(stage: int, link: str, accum: int = 1) -> list[dict]:
    command = [sys.executable, "-m", "tfdist.cli.launch", "--num_workers=2"]
    if link != "loopback":
        command.append(f"--link_rate={link}")
    command += ["--", sys.executable, os.path.abspath(__file__), f"--worker={stage}", f"--grad_accum_steps={accum}"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=REPO)
    rows = [json.loads(m) for m in re.findall(r"ZERO (\{.*\})", run.stdout)]
    if not rows:
        raise SystemExit(f"stage {stage} on {link}: no figures (exit {run.returncode}):\n{run.stderr[-3000:]}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--links", default="loopback,1gbit")
    parser.add_argument("--repeats", type=int, default=1, help="Alternating rounds of stages 0, 1, 2, 3.")
    parser.add_argument("--stages", default=",".join(map(str, STAGES)), help="Which stages, e.g. 0,3.")
    parser.add_argument("--grad_accum_steps", type=int, default=1,
                        help="Micro-batches a step (the global batch split in them; stage 2 then accumulates only "
                             "the owned slices, stage 1 the whole local gradient).")
    parser.add_argument("--malloc_tuned", action="store_true",
                        help="Run the workers with MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=1048576 (glibc then "
                             "keeps less freed heap, which peak RSS counts).")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "zero_memory.json"))
    args = parser.parse_args()
    stages = tuple(int(s) for s in args.stages.split(","))
    if args.malloc_tuned:
        os.environ.update(MALLOC_ARENA_MAX="2", MALLOC_MMAP_THRESHOLD_="1048576")
    if args.worker is not None:
        worker(args.worker, args.grad_accum_steps)
        return
    started = time.time()
    runs = []
    for link in args.links.split(","):
        for _ in range(args.repeats):
            for stage in stages:
                rows = launch(stage, link, args.grad_accum_steps)
                runs.append({"link": link, "stage": stage, "workers": rows})
                print(link, stage, rows, flush=True)
    summary = []
    for link in args.links.split(","):
        base = [r for r in runs if r["link"] == link and r["stage"] == 0]
        for stage in stages:
            mine = [w for r in runs if r["link"] == link and r["stage"] == stage for w in r["workers"]]
            base_workers = [w for r in base for w in r["workers"]]
            peak, state = max(w["peak_rss_mb"] for w in mine), max(w["optimizer_state_mb"] for w in mine)
            step = sorted(w["step_ms"] for w in mine)[len(mine) // 2]
            base_step = sorted(w["step_ms"] for w in base_workers)[len(base_workers) // 2]
            # What the stage takes off a worker: its share of Adam's moments, and at stage 2 of the gradient.
            removed = max(w["optimizer_state_mb"] for w in base_workers) - state
            if stage >= 2:
                removed += WEIGHTS_MB / 2  # 2 workers: each keeps half of the gradient,
            if stage >= 3:
                removed += WEIGHTS_MB / 2  # and at stage 3 of the weights.
            saved = max(w["peak_rss_mb"] for w in base_workers) - peak
            summary.append({"link": link, "stage": stage, "peak_rss_mb_max_worker": peak,
                            "optimizer_state_mb_per_worker": state,
                            "peak_saved_mb": saved, "bytes_removed_mb": round(removed, 1),
                            "allocator_peak_mib_max_worker": max(w["allocator_peak_mib"] for w in mine),
                            "step_peak_mib_max_worker": max(w["step_peak_mib"] for w in mine),
                            "saved_over_removed": round(saved / removed, 2) if removed else None,
                            "step_ms_median": step, "speed_vs_unsharded": round(base_step / step, 3)})
    out = {"machine": os.uname().nodename, "cores": os.cpu_count(), "model": f"{DEPTH} x {WIDTH} MLP, Adam",
           "batch": BATCH, "steps_per_epoch": STEPS,
           "grad_accum_steps": args.grad_accum_steps, "malloc_tuned": args.malloc_tuned, "runs": runs, "summary": summary,
           "seconds": round(time.time() - started)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("| link | stage | optimizer state / worker (MB) | peak RSS, larger worker (MB) | peak saved / bytes removed |"
          " allocator peak: run / steps (MiB) | step (ms) | speed vs unsharded |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in summary:
        print(f"| {s['link']} | {s['stage']} | {s['optimizer_state_mb_per_worker']} | {s['peak_rss_mb_max_worker']} | "
              f"{s['peak_saved_mb']} / {s['bytes_removed_mb']} | {s['allocator_peak_mib_max_worker']} / "
              f"{s['step_peak_mib_max_worker']} | "
              f"{s['step_ms_median']} | {s['speed_vs_unsharded']} |")


if __name__ == "__main__":
    main()

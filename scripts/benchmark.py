"""Side-by-side throughput benchmarks, each row a ratio measured in one run, drawn as a chart.

Every measurement runs in its own process; the two sides of a row alternate
(A, B, A, B, ...) so drift on a shared machine hits both, and each row's ratio
is taken between the medians of its two sides. Throughput is training examples
per second over epochs 2..N (the first epoch pays for tracing and start-up on
both sides; evaluation is never timed).

  python scripts/benchmark.py                                  # every row this machine can run
  python scripts/benchmark.py --rows=fit,spe --repeats=5 --epochs=4 --out_dir=benchmarks
  python scripts/benchmark.py --rows=ps_embedding --repeats=3                   # the ShardedEmbedding rows alone
  python scripts/benchmark.py --horovod_python=.nox/tests-tf2-18-horovod/bin/python   # adds the horovod rows
  python scripts/benchmark.py --rows=peers,comm                # tfdist against its peers; a shaped link

The rows are declared in scripts/benchlib/rows.py; benchlib/runner.py runs them,
benchlib/stats.py does the arithmetic, benchlib/chart.py draws. It writes OUT_DIR/benchmark.json (every raw measurement, medians, min/max,
ratios, targets and the machine) and OUT_DIR/benchmark.png (needs matplotlib:
``pip install 'tfdist[bench]'``).

CPU rows (pinned to the CPU with CUDA_VISIBLE_DEVICES="" on a GPU machine):
  fit        tfdist-train vs Keras 3 model.fit, both with the same steps_per_execution (10), schedule
             (WarmupCosine), precision, batch (128), data (bundled digits) and CNN.
  input      tfdist-train on the bundled digits vs --dataset=synthetic (examples/s: 8,000 vs 8,192 examples).
  bf16       --precision=mixed_bfloat16 vs float32.
  jit        --jit_compile=true (XLA) vs false.
  mwms       MultiWorkerMirroredStrategy, 2 workers over loopback (tfdist-launch) vs 1 worker, same global
             batch; plus an estimate of the communication share of a 2-worker step.
  allreduce  MWMS 2 workers: --all_reduce=ring vs auto (row allreduce), --all_reduce_dtype=bfloat16 vs
             float32 (ar_bf16), --all_reduce_pack_mb=0.25 vs 0, one pack: TensorFlow's default (ar_pack).
  ps         ParameterServerStrategy, 1 ps + 2 workers over loopback vs 1 local worker, same global batch.
  ps_embedding  ParameterServerStrategy, 2 ps + 2 workers over loopback, scripts/ps_embedding.py: ids (one
             random id per example) -> embedding (N x 64) -> Flatten -> Dense(1), batch 1024, trained with
             tfdist.fit. Rows sharded_vs_keras_sgd and sharded_vs_keras_adagrad: tfdist.layers.ShardedEmbedding
             vs keras.layers.Embedding, 1,000,000 x 64 table (target >= 20x); row rows_1m_vs_10k:
             ShardedEmbedding with 1,000,000 rows vs 10,000 rows, SGD (target >= 0.80, i.e. 1M's step within
             1.25x of 10k's). Examples/s over epochs 2..N of 5 x steps_per_execution steps (Keras' Embedding, which
             reads its whole table every step: 2 x steps_per_execution steps), so A / B is B's step time over A's.
  horovod    Horovod 2 ranks (horovodrun --gloo) vs MWMS 2 workers, same global batch and TensorFlow
             (both sides run with --horovod_python, an environment with horovod, e.g. TF 2.18).
  hvd_fp16   Horovod 2 ranks, --hvd_compression=fp16 vs none (with --horovod_python).
  hvd_cycle  Horovod 2 ranks, HOROVOD_CYCLE_TIME=0.2 (ms) vs Horovod's default (1 ms; tfdist leaves it and
             HOROVOD_FUSION_THRESHOLD, 128 MB, at Horovod's defaults) (with --horovod_python).
  spe        a sweep: tfdist-train vs model.fit at steps_per_execution 1, 2, 5, 10, 20, 50.
  peers      tfdist-train against what a user would run instead, same CNN, digits, global batch (128), Adam at a
             constant rate, float32: peer_mwms (2 MWMS workers: tf_keras model.fit, scripts/peer_tf_keras.py),
             peer_ps (1 ps + 2 workers: tf_keras fit under ParameterServerStrategy), peer_mirrored (2 CPU
             replicas: Keras 3 fit under MirroredStrategy, at steps_per_execution 1, the most it runs there) and,
             with --horovod_python, peer_horovod (horovod.tensorflow.keras + tf_keras, scripts/peer_horovod_keras.py).
  comm       scripts/comm_mlp.py (a 2.6M-weight MLP, synthetic data, global batch 1024, SGD, spe 4) on 2 workers
             over a loopback shaped to 1 Gbit/s (tfdist-launch --link_rate=1gbit): comm_mwms (tfdist against
             the bound t_forward + max(t_backward, t_comm), each measured in the same run by --measure_bound,
             scripts/overlap_probe.py's timings; B: 2 copies at once at batch 512 with no communication, for
             the scaling model), comm_tf_keras (vs tf_keras fit), comm_bf16 (bfloat16 all-reduce vs
             float32), comm_accum (4 accumulated micro-batches a step vs 1), comm_ps (1 ps + 2 workers, vs
             tf_keras fit) and comm_ps_unshaped (the same on an unshaped loopback).
GPU rows (only where GPUs are found, or --gpus=N):
  gpu        gpu_fit (1 GPU: tfdist vs model.fit), gpu_bf16 and gpu_fp16 (vs float32), gpu_xla (XLA on vs
             off), gpu_mirrored (N GPUs mirrored vs 1 GPU, same global batch; needs N >= 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Callable, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib, beside this script.

from benchlib.chart import MATPLOTLIB_MISSING, draw, import_pyplot, markdown_table  # noqa: E402,F401
from benchlib.machine import count_gpus, machine_facts  # noqa: E402
from benchlib.rows import (REPO, SPE_SWEEP, TARGETS, Row, Settings, Side, CPU_GROUPS, GPU_GROUPS,  # noqa: E402,F401
                           expand, select_rows, skipped_groups)
from benchlib.runner import _env, measure, run_side  # noqa: E402,F401
from benchlib.stats import overhead_model, scaling_model, scaling_table  # noqa: E402


def _print_row(result: dict) -> None:
    a, b = result["a"], result["b"]
    target = ""
    if result["target"] is not None:
        target = (f"  score {result['scored']:.3f}, target >= {result['target']:.2f}: "
                  f"{'met' if result['target_met'] else 'NOT met'}")
    print(f"{result['row']:>14}: {a['label']} / {b['label']} = {result['ratio_a_over_b']:.3f}  "
          f"(examples/s {a['examples_per_sec']} vs {b['examples_per_sec']}; eval accuracy "
          f"{a['eval_accuracy']} vs {b['eval_accuracy']}; ms/step {result['a_step_ms']} vs {result['b_step_ms']})"
          f"{target}"
          + (f" {result['extra']}" if "extra" in result else ""), flush=True)
    for side in (a, b):
        if side["exit_status"] != [0]:
            print(f"{'':>14}  note: {side['label']} printed its figures but exited with {side['exit_status']}",
                  flush=True)


def default_horovod_python() -> Optional[str]:
    here = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return sys.executable if os.path.exists(here) else None


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="all", help=f"Comma-separated: all, {', '.join(CPU_GROUPS + GPU_GROUPS)}")
    parser.add_argument("--repeats", type=int, default=3, help="Alternating runs per side.")
    parser.add_argument("--epochs", type=int, default=4, help="Epochs per run (throughput over epochs 2..N).")
    parser.add_argument("--batch", type=int, default=128, help="Global batch size.")
    parser.add_argument("--precision", default="float32", help="Precision of every row but bf16/gpu_fp16/gpu_bf16.")
    parser.add_argument("--steps_per_execution", type=int, default=10, help="For every row but the spe sweep.")
    parser.add_argument("--gpus", type=int, default=-1, help="GPUs to use for GPU rows (-1: as nvidia-smi lists).")
    parser.add_argument("--horovod_python", default=default_horovod_python(),
                        help="Python of an environment with horovod (horovodrun beside it), for the horovod rows; "
                             "both sides of those rows run with it.")
    parser.add_argument("--out_dir", default=os.path.join(REPO, "benchmarks"),
                        help="Where benchmark.json and benchmark.png go.")
    parser.add_argument("--no_chart", action="store_true", help="Write benchmark.json only (no matplotlib).")
    args = parser.parse_args(argv)
    try:
        expand(args.rows.split(","))
    except ValueError as e:
        parser.error(str(e))
    if args.repeats < 1 or args.epochs < 1:
        parser.error("--repeats and --epochs must be 1 or more.")
    return args


def main(argv: Optional[Sequence[str]] = None, run: Callable[[Side], dict] = run_side) -> dict:
    args = parse_args(argv)
    if not args.no_chart:
        import_pyplot()  # Fail now, not after the measurements.
    gpus = count_gpus() if args.gpus < 0 else args.gpus
    settings = Settings(epochs=args.epochs, batch=args.batch, precision=args.precision,
                        steps_per_execution=args.steps_per_execution, horovod_python=args.horovod_python)
    requested = args.rows.split(",")
    rows = select_rows(requested, gpus, settings)
    skipped = skipped_groups(requested, gpus, settings)
    for group, why in skipped.items():
        print(f"skipping {group}: {why}", flush=True)
    start = time.perf_counter()
    report = {"machine": machine_facts(gpus, settings),
              "settings": {**dataclasses.asdict(settings), "repeats": args.repeats, "rows": args.rows},
              "targets": TARGETS, "skipped": skipped, "failed": [], "rows": []}
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, "benchmark.json")
    for row in rows:
        try:
            result = measure(row, args.repeats, run)
        except RuntimeError as e:  # One broken row must not cost the others' measurements.
            report["failed"].append({"row": row.name, "error": str(e)[-4000:]})
            print(f"{row.name:>14}: FAILED {str(e)[-1500:]}", flush=True)
            continue
        report["rows"].append(result)
        _print_row(result)
        report["duration_seconds"] = round(time.perf_counter() - start, 1)
        with open(json_path, "w") as f:  # After every row: a long run interrupted keeps what it measured.
            json.dump(report, f, indent=2)
    report["spe_sweep"] = [{"steps_per_execution": r["spe"], "tfdist_median": r["a"]["median"],
                            "keras_median": r["b"]["median"], "ratio": r["ratio_a_over_b"]}
                           for r in report["rows"] if r["spe"] is not None]
    report["spe_overhead_model"] = overhead_model(report["rows"])
    report["scaling_model"] = scaling_model(report["rows"])
    report["duration_seconds"] = round(time.perf_counter() - start, 1)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {json_path} ({report['duration_seconds']:.0f} s)", flush=True)
    print(markdown_table(report), flush=True)
    if report["scaling_model"]:
        print(json.dumps(report["scaling_model"]["checks"]), "\n" + scaling_table(report["scaling_model"]), flush=True)
    if not args.no_chart and report["rows"]:
        png = os.path.join(args.out_dir, "benchmark.png")
        draw(report, png)
        print(f"wrote {png}", flush=True)
    return report


if __name__ == "__main__":
    main()


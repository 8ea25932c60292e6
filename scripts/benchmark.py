"""Side-by-side throughput benchmarks, each row a ratio measured in one run.

Every measurement runs in its own process; the two sides of a row alternate
(A, B, A, B, ...) so drift on a shared machine hits both, and the ratio is
taken between medians. Throughput is training examples per second over
epochs 2..N (the first epoch pays for tracing and start-up in both).

  python scripts/benchmark.py                  # every row
  python scripts/benchmark.py --rows=fit --repeats=5 --epochs=4 --json=bench.json

Rows:
  fit   tfdist-train (default strategy) vs plain Keras 3 model.fit: same model, data, batch, precision.
  mwms  MultiWorkerMirroredStrategy, 2 workers over loopback (tfdist-launch) vs 1 worker, same global
        batch; plus an estimate of the all-reduce share of a 2-worker step.
  ps    ParameterServerStrategy, 1 ps + 2 workers over loopback vs 1 local worker, same global batch.
  horovod  Horovod with 2 ranks (horovodrun --gloo) vs MultiWorkerMirroredStrategy with 2 workers, same
        global batch and TensorFlow version; run with the TF 2.18 + horovod environment's python.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def steady_throughput(metrics: dict) -> float:
    seconds = metrics["epoch_train_seconds"][1:] or metrics["epoch_train_seconds"]
    return len(seconds) * metrics["steps_per_epoch"] * metrics["global_batch_size"] / sum(seconds)


def _env() -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TF_CONFIG", None)
    return env


def run_json(cmd: list[str]) -> dict:
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO)
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def tfdist_train(flags: list[str], launcher: list[str] | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="tfdist-bench-") as workdir:
        cmd = [*(launcher or []), sys.executable, "-m", "tfdist.cli.train", f"--workdir={workdir}/w", *flags]
        result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO)
        if result.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
        with open(os.path.join(workdir, "w", "metrics.json")) as f:
            return json.load(f)


def row_fit(args: argparse.Namespace) -> tuple[str, Callable[[], dict], str, Callable[[], dict]]:
    common = [f"--epochs={args.epochs}", f"--precision={args.precision}"]
    return (
        "tfdist-train (default strategy)",
        lambda: tfdist_train(["--strategy=default", "--global_batch_size=128", *common]),
        "Keras 3 model.fit",
        lambda: run_json([sys.executable, os.path.join(REPO, "scripts", "keras_fit_baseline.py"),
                          "--batch_size=128", *common]),
    )


LAUNCH = [sys.executable, "-m", "tfdist.cli.launch"]


def row_mwms(args: argparse.Namespace) -> tuple[str, Callable[[], dict], str, Callable[[], dict]]:
    common = ["--strategy=multi_worker_mirrored", "--global_batch_size=128", f"--epochs={args.epochs}",
              f"--precision={args.precision}"]
    return (
        "2 workers over loopback",
        lambda: tfdist_train(common, launcher=[*LAUNCH, "--num_workers=2", "--"]),
        "1 worker",
        lambda: tfdist_train(common),
    )


def extra_mwms(args: argparse.Namespace, a: list[dict]) -> dict:
    """Estimates the all-reduce share of a 2-worker step from a 1-worker run at half the batch.

    A worker of the 2-worker job computes on 64 examples per step, as the
    1-worker run at batch 64 does; the rest of its step time is communication
    and synchronisation. On a machine with fewer cores than the job needs the
    workers also compete for CPU, which this counts as communication.
    """
    half = [tfdist_train(["--strategy=multi_worker_mirrored", "--global_batch_size=64", f"--epochs={args.epochs}",
                          f"--precision={args.precision}"]) for _ in range(args.repeats)]

    def step_seconds(m: dict) -> float:
        seconds = m["epoch_train_seconds"][1:] or m["epoch_train_seconds"]
        return sum(seconds) / (len(seconds) * m["steps_per_epoch"])

    compute = statistics.median(step_seconds(m) for m in half)
    full = statistics.median(step_seconds(m) for m in a)
    return {"one_worker_half_batch_step_ms": round(1000 * compute, 3), "two_worker_step_ms": round(1000 * full, 3),
            "allreduce_share_estimate": round(max(0.0, 1 - compute / full), 3)}


def row_ps(args: argparse.Namespace) -> tuple[str, Callable[[], dict], str, Callable[[], dict]]:
    common = ["--global_batch_size=128", f"--epochs={args.epochs}", f"--precision={args.precision}"]
    return (
        "parameter servers: 1 ps + 2 workers over loopback",
        lambda: tfdist_train(["--strategy=parameter_server", *common],
                             launcher=[*LAUNCH, "--num_workers=2", "--num_ps=1", "--"]),
        "1 local worker (default strategy)",
        lambda: tfdist_train(["--strategy=default", *common]),
    )


def row_horovod(args: argparse.Namespace) -> tuple[str, Callable[[], dict], str, Callable[[], dict]]:
    """Needs the TensorFlow 2.18 + horovod environment (run this script with its python)."""
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(horovodrun):
        raise SystemExit(f"row horovod needs horovodrun next to {sys.executable}; run the script with the python "
                         "of an environment with horovod (e.g. .nox/tests-tf2-18-horovod/bin/python).")
    common = ["--global_batch_size=128", f"--epochs={args.epochs}", f"--precision={args.precision}"]
    return (
        "Horovod, 2 ranks (Gloo)",
        lambda: tfdist_train(["--strategy=horovod", *common],
                             launcher=[horovodrun, "-np", "2", "-H", "localhost:2", "--gloo"]),
        "MultiWorkerMirroredStrategy, 2 workers",
        lambda: tfdist_train(["--strategy=multi_worker_mirrored", *common],
                             launcher=[*LAUNCH, "--num_workers=2", "--"]),
    )


ROWS = {"fit": row_fit, "mwms": row_mwms, "ps": row_ps, "horovod": row_horovod}
EXTRAS = {"mwms": extra_mwms}


def measure(name: str, args: argparse.Namespace) -> dict:
    label_a, run_a, label_b, run_b = ROWS[name](args)
    a, b = [], []
    for _ in range(args.repeats):
        a.append(run_a())
        b.append(run_b())
    ta, tb = [steady_throughput(m) for m in a], [steady_throughput(m) for m in b]
    extra = EXTRAS[name](args, a) if name in EXTRAS else {}
    return {**extra,
        "row": name, "a": label_a, "b": label_b,
        "a_examples_per_sec": [round(x) for x in ta], "b_examples_per_sec": [round(x) for x in tb],
        "a_eval_accuracy": [round(m["eval_accuracy"], 4) for m in a],
        "b_eval_accuracy": [round(m["eval_accuracy"], 4) for m in b],
        "ratio_a_over_b": round(statistics.median(ta) / statistics.median(tb), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="fit,mwms,ps" if "horovod" not in sys.modules and not os.path.exists(
        os.path.join(os.path.dirname(sys.executable), "horovodrun")) else ",".join(ROWS), help=f"Comma-separated subset of: {', '.join(ROWS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--json", help="Also write the results to this file.")
    args = parser.parse_args()
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; valid rows: {', '.join(ROWS)}")
    results = []
    for name in args.rows.split(","):
        result = measure(name, args)
        results.append(result)
        extra = {k: v for k, v in result.items() if k not in ("row", "a", "b", "a_examples_per_sec",
                 "b_examples_per_sec", "a_eval_accuracy", "b_eval_accuracy", "ratio_a_over_b")}
        print(f"{name:>6}: {result['a']} / {result['b']} = {result['ratio_a_over_b']:.3f}  "
              f"(examples/s {result['a_examples_per_sec']} vs {result['b_examples_per_sec']}; "
              f"eval accuracy {result['a_eval_accuracy']} vs {result['b_eval_accuracy']})"
              + (f" {extra}" if extra else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

"""Side-by-side throughput benchmarks, each row a ratio measured in one run.

Every measurement runs in its own process; the two sides of a row alternate
(A, B, A, B, ...) so drift on a shared machine hits both, and the ratio is
taken between medians. Throughput is training examples per second over
epochs 2..N (the first epoch pays for tracing and start-up in both).

  python scripts/benchmark.py                  # every row
  python scripts/benchmark.py --rows=fit --repeats=5 --epochs=4 --json=bench.json

Rows:
  fit   tfdist-train (default strategy) vs plain Keras 3 model.fit: same model, data, batch, precision.
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


ROWS = {"fit": row_fit}


def measure(name: str, args: argparse.Namespace) -> dict:
    label_a, run_a, label_b, run_b = ROWS[name](args)
    a, b = [], []
    for _ in range(args.repeats):
        a.append(run_a())
        b.append(run_b())
    ta, tb = [steady_throughput(m) for m in a], [steady_throughput(m) for m in b]
    return {
        "row": name, "a": label_a, "b": label_b,
        "a_examples_per_sec": [round(x) for x in ta], "b_examples_per_sec": [round(x) for x in tb],
        "a_eval_accuracy": [round(m["eval_accuracy"], 4) for m in a],
        "b_eval_accuracy": [round(m["eval_accuracy"], 4) for m in b],
        "ratio_a_over_b": round(statistics.median(ta) / statistics.median(tb), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"Comma-separated subset of: {', '.join(ROWS)}")
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
        print(f"{name:>6}: {result['a']} / {result['b']} = {result['ratio_a_over_b']:.3f}  "
              f"(examples/s {result['a_examples_per_sec']} vs {result['b_examples_per_sec']}; "
              f"eval accuracy {result['a_eval_accuracy']} vs {result['b_eval_accuracy']})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

"""A model that does not fit, measured: examples/big_mlp.py under one cgroup memory limit, unsharded and at stage 3.

One process of 4 CPU replicas (CPU_REPLICAS=4), STEPS=2. First the stage-3 run of `--stage3_width` is run without
a limit; the limit L is its cgroup peak (memory.max_usage_in_bytes) plus `--margin_mb`. Then, under L, the
unsharded run at each width from `--widths` (ascending): the largest that trains is the largest unsharded model
under L. Last, under L, the stage-3 run of `--stage3_width` must train, and its unsharded run must be killed.
Prints one JSON line per run and a summary (widths, parameter counts, peaks, their ratio).

Needs root and a writable cgroup-v1 memory controller (/sys/fs/cgroup/memory), as tests/test_examples.py.

  python scripts/zero3_fit_limit.py --stage3_width=4096 --widths=2048,2304,2560,2816,3072
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMORY_CGROUP = "/sys/fs/cgroup/memory"
DEPTH = int(os.environ.get("DEPTH", "4"))  # big_mlp's layers (its DEPTH, passed on).


def params(width: int) -> int:
    """big_mlp's parameter count: DEPTH - 1 width x width Dense layers and a 10-way head."""
    return (DEPTH - 1) * (width * width + width) + width * 10 + 10


def run(width: int, stage: int, limit: int, name: str) -> dict:
    """big_mlp.py in a new memory cgroup of `limit` bytes: exit status, failcnt, cgroup peak, seconds."""
    path = os.path.join(MEMORY_CGROUP, f"tfdist-zero3-limit-{os.getpid()}-{name}")
    os.mkdir(path)
    try:
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO, "CPU_REPLICAS": "4",
               "STEPS": "2", "DEPTH": str(DEPTH), "WIDTH": str(width), "ZERO_STAGE": str(stage)}
        start = time.monotonic()
        result = subprocess.run(["sh", "-c", f'echo $$ > {path}/cgroup.procs && exec "$@"', "sh", sys.executable,
                                 "examples/big_mlp.py"], capture_output=True, text=True, cwd=REPO, env=env)
        seconds = time.monotonic() - start
        with open(os.path.join(path, "memory.failcnt")) as f, \
                open(os.path.join(path, "memory.max_usage_in_bytes")) as g:
            failcnt, peak = int(f.read()), int(g.read())
    finally:
        os.rmdir(path)
    line = {"width": width, "params": params(width), "zero_stage": stage, "limit_mb": limit >> 20,
            "returncode": result.returncode, "failcnt": failcnt, "peak_mb": peak >> 20,
            "seconds": round(seconds, 1), "printed": result.stdout.strip()[-200:]}
    if result.returncode not in (0, -9):
        line["stderr"] = result.stderr[-1500:]
    print(json.dumps(line), flush=True)
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage3_width", type=int, default=4096)
    parser.add_argument("--widths", default="2048,2304,2560,2816,3072")
    parser.add_argument("--margin_mb", type=int, default=256)
    args = parser.parse_args()
    measured = run(args.stage3_width, 3, 2 ** 62, "measure")
    assert measured["returncode"] == 0, measured
    limit = (measured["peak_mb"] + args.margin_mb) << 20
    largest = None
    for width in sorted(int(w) for w in args.widths.split(",")):
        if run(width, 0, limit, f"unsharded-{width}")["returncode"] != 0:
            break
        largest = width
    stage3 = run(args.stage3_width, 3, limit, "stage3")
    unsharded = run(args.stage3_width, 0, limit, "unsharded")
    summary = {"limit_mb": limit >> 20, "largest_unsharded_width": largest,
               "largest_unsharded_params": largest and params(largest), "stage3_width": args.stage3_width,
               "stage3_params": params(args.stage3_width),
               "ratio": largest and round(params(args.stage3_width) / params(largest), 2),
               "stage3_trains": stage3["returncode"] == 0, "stage3_peak_mb": stage3["peak_mb"],
               "unsharded_killed": unsharded["returncode"] == -9 and unsharded["failcnt"] > 0}
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()

"""Runs a row: each side in fresh processes, alternating A, B, A, B, ...; reads what each run reported.

tfdist-train and scripts/ps_embedding.py write WORKDIR/metrics.json; the other
programs print one line ``BENCH {json}`` (the baseline, an unprefixed JSON
line), under tfdist-launch prefixed with the task's name. A peer program's job
that printed its figures but exited non-zero (tf_keras' MWMS workers have no
exit barrier, so one may fail once its peer is gone) is kept, with the status
recorded; a tfdist side must exit 0.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import subprocess
import tempfile
import time
from typing import Callable, Optional

from benchlib import stats
from benchlib.rows import REPO, WRITES_METRICS, Row, Side
from tfdist.launcher import threads


def _env(side: Side) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["CUDA_VISIBLE_DEVICES"] = side.visible_gpus
    env.pop("TF_CONFIG", None)
    for name in ("HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD"):  # Only where a row sets them.
        env.pop(name, None)
    if side.launcher[:1] in (("parallel",), ("horovodrun",)):
        # N processes on this machine that tfdist-launch does not start: the thread split it gives its
        # tasks (--threads_per_task=auto), so both sides of a row size their thread pools alike.
        env.update(threads.local("auto", int(side.launcher[1]), user=set(env)).env)
    env.update(dict(side.env))
    return env


def printed_metrics(stdout: str) -> Optional[dict]:
    """The last ``BENCH {json}`` line (or bare JSON line) a run printed, whatever prefix a launcher added."""
    for line in reversed(stdout.strip().splitlines()):
        if "BENCH {" in line:
            text = line[line.index("BENCH {") + len("BENCH "):]
        elif line.startswith("{"):
            text = line
        else:
            continue
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise RuntimeError(f"a run printed figures that are not JSON ({e}): {line[:300]}") from None
    return None


def is_peer(side: Side) -> bool:
    """A side that runs another framework's program (tf_keras, Horovod's Keras), not tfdist."""
    return side.program.startswith("peer") or "--framework=tf_keras" in side.flags


def _start(side: Side, workdir: str) -> list[subprocess.Popen]:
    copies = int(side.launcher[1]) if side.launcher[:1] == ("parallel",) else 1
    return [subprocess.Popen(side.command(f"{workdir}{i}" if i else workdir), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env(side), cwd=REPO) for i in range(copies)]


def run_side(side: Side) -> dict:
    """Runs one side once in fresh processes (N at once for a "parallel" side: the first one reports)."""
    with tempfile.TemporaryDirectory(prefix="tfdist-bench-") as tmp:
        workdir = os.path.join(tmp, "w")
        start = time.perf_counter()
        processes = _start(side, workdir)
        with concurrent.futures.ThreadPoolExecutor(len(processes)) as pool:  # Drain every copy's pipes at once.
            outputs = list(pool.map(lambda p: (p, *p.communicate()), processes))
        process, stdout, stderr = outputs[0]
        failed = [(p, out, err) for p, out, err in outputs if p.returncode]
        metrics = None
        if side.program not in WRITES_METRICS:
            metrics = printed_metrics(stdout)
        elif not failed:
            with open(os.path.join(workdir, "metrics.json")) as f:
                metrics = json.load(f)
        if metrics is None or (failed and not is_peer(side)):
            p, out, err = failed[0] if failed else outputs[0]
            raise RuntimeError(f"{' '.join(p.args)} failed ({p.returncode}):\n{err[-3000:]}\n{out[-2000:]}")
        metrics["exit_status"] = process.returncode
        metrics["process_seconds"] = round(time.perf_counter() - start, 2)
        return metrics


def extra_mwms(row: Row, a_runs: list[dict], repeats: int, run: Callable[[Side], dict]) -> dict:
    """Estimates the communication share of a 2-worker step from 1-worker runs at half the batch.

    A worker of the 2-worker job computes on half the global batch per step, as
    the 1-worker run at half the batch does; the rest of its step time is
    all-reduce and synchronisation. On a machine with fewer cores than the job
    needs the workers also compete for CPU, which this counts as communication.
    """
    half_flags = tuple(f"--global_batch_size={int(f.split('=')[1]) // 2}" if f.startswith("--global_batch_size=")
                       else f for f in row.b.flags)
    half = [run(dataclasses.replace(row.b, flags=half_flags)) for _ in range(repeats)]
    compute = stats.median_step_ms(half)
    full = stats.median_step_ms(a_runs)
    return {"one_worker_half_batch_step_ms": round(compute, 3), "two_worker_step_ms": round(full, 3),
            "communication_share_estimate": round(max(0.0, 1 - compute / full), 3)}


def extra_comm(row: Row, a_runs: list[dict], b_runs: list[dict]) -> dict:
    """A comm row's link, gradient bytes and A's step; for a bound-scored row (comm_mwms) the bound A's runs
    measured, and the nominal ideal from B's compute alone (informative; stats.scaling_model calibrates on it)."""
    rate = row.a.link_rate
    gradient_bytes = a_runs[0]["gradient_bytes"]
    measured = stats.median_step_ms(a_runs)
    extra = {"link_rate": rate, "gradient_bytes": gradient_bytes, "a_step_ms": round(measured, 2)}
    if row.score == "bound":
        bound = stats.bound_figures(a_runs)
        extra.update(bound, bound_over_measured=round(bound["bound_ms"] / measured, 3))
        ideal = stats.ideal_step(stats.median_step_ms(b_runs), gradient_bytes, rate)
        extra.update(ideal, ideal_over_measured=round(ideal["ideal_ms"] / measured, 3))
    return extra


def measure(row: Row, repeats: int, run: Callable[[Side], dict] = run_side) -> dict:
    a_runs, b_runs = [], []
    for _ in range(repeats):  # Alternate, so drift on a shared machine hits both sides.
        a_runs.append(run(row.a))
        b_runs.append(run(row.b))
    a, b = stats.summary(row.a, a_runs), stats.summary(row.b, b_runs)
    ratio = a["median"] / b["median"]
    result = {
        "row": row.name, "group": row.group, "title": row.title, "device": row.device, "spe": row.spe,
        "a": a, "b": b, "ratio_a_over_b": round(ratio, 3),
        "ratio_min_max": [round(a["min"] / b["max"], 3), round(a["max"] / b["min"], 3)],
        "a_step_ms": round(stats.median_step_ms(a_runs), 3), "b_step_ms": round(stats.median_step_ms(b_runs), 3),
        "score": row.score, "target": row.target,
    }
    if row.name == "mwms":
        result["extra"] = extra_mwms(row, a_runs, repeats, run)
    if row.group == "comm":
        result["extra"] = extra_comm(row, a_runs, b_runs)
    scored = result["extra"]["bound_over_measured"] if row.score == "bound" else ratio
    result["scored"] = round(scored, 3)
    result["target_met"] = stats.target_met(row.target, scored)
    return result

"""The benchmark's statistics: throughput over the steady epochs, medians, step times, the ideal of a
communication-bound step, and the steps_per_execution overhead fit."""

from __future__ import annotations

import statistics
from typing import Optional

from benchlib.rows import Side


def steady_throughput(metrics: dict) -> float:
    """Examples per second over epochs 2..N (all epochs if there is only one)."""
    seconds = metrics["epoch_train_seconds"][1:] or metrics["epoch_train_seconds"]
    return len(seconds) * metrics["steps_per_epoch"] * metrics["global_batch_size"] / sum(seconds)


def step_ms(metrics: dict) -> float:
    """Milliseconds per training step over epochs 2..N."""
    seconds = metrics["epoch_train_seconds"][1:] or metrics["epoch_train_seconds"]
    return 1000 * sum(seconds) / (len(seconds) * metrics["steps_per_epoch"])


def median_step_ms(runs: list[dict]) -> float:
    return statistics.median(step_ms(m) for m in runs)


def summary(side: Side, runs: list[dict]) -> dict:
    """One side's runs: examples/s of each, their median, min and max, and what each run reported."""
    throughput = [steady_throughput(m) for m in runs]
    return {
        "label": side.label,
        "command": " ".join([*(f"{k}={v}" for k, v in side.env), *side.command("WORKDIR")]),
        "cuda_visible_devices": side.visible_gpus,
        "examples_per_sec": [round(x, 1) for x in throughput],
        "median": round(statistics.median(throughput), 1),
        "min": round(min(throughput), 1),
        "max": round(max(throughput), 1),
        "eval_accuracy": [None if m.get("eval_accuracy") is None else round(m["eval_accuracy"], 4) for m in runs],
        "epoch_train_seconds": [[round(s, 4) for s in m["epoch_train_seconds"]] for m in runs],
        "steps_per_epoch": runs[0]["steps_per_epoch"],
        "global_batch_size": runs[0]["global_batch_size"],
        "process_seconds": [m["process_seconds"] for m in runs],
        "exit_status": sorted({m.get("exit_status", 0) for m in runs}),
        "tensorflow_version": runs[0].get("tensorflow_version"),
        "precision": runs[0].get("precision"),
        "dataset": runs[0].get("dataset", "mnist"),
    }


def parse_rate(rate: str) -> float:
    """Bits per second of a tc rate such as "1gbit" or "100mbit"."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise ValueError(f"unknown rate {rate!r}")


def ideal_step(compute_ms: float, gradient_bytes: int, link_rate: str, workers: int = 2) -> dict:
    """The ideal step of a ring all-reduce over one shared link, and the fully serial one.

    Each of `workers` sends 2 (w - 1) / w of the gradient bytes a step; on one
    machine all of it crosses the one shaped loopback, so moving a step's
    gradients takes bytes x 2 (w - 1) / link rate (bytes x 2 for 2 workers).
    Perfect overlap hides the shorter of compute and communication:
    ideal = max(compute, comm); with none, a step takes compute + comm.
    """
    comm = 1000 * gradient_bytes * 8 * 2 * (workers - 1) / parse_rate(link_rate)
    ideal, serial = max(compute_ms, comm), compute_ms + comm
    return {"compute_ms": round(compute_ms, 2), "comm_ms": round(comm, 2), "ideal_ms": round(ideal, 2),
            "serial_ms": round(serial, 2), "serial_over_ideal": round(ideal / serial, 3)}


def overhead_model(results: list[dict]) -> dict:
    """Where step time goes, from the spe sweep: a least-squares fit of step_ms = compute + per_call / spe.

    ``compute_ms_per_step`` is what a step costs however many steps share a
    call; ``per_call_ms`` is the fixed cost of one execution (Python, dispatch,
    reading back results), paid once per ``steps_per_execution`` steps.
    """
    sweep = [r for r in results if r["spe"] is not None]
    if len(sweep) < 2:
        return {}
    fits = {}
    for side, name in (("a", "tfdist"), ("b", "keras")):
        xs = [1.0 / r["spe"] for r in sweep]
        ys = [1000.0 * r[side]["global_batch_size"] / r[side]["median"] for r in sweep]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        fits[name] = {"compute_ms_per_step": round(my - slope * mx, 3), "per_call_ms": round(slope, 3),
                      "step_ms_by_spe": {str(r["spe"]): round(y, 3) for r, y in zip(sweep, ys)}}
    return fits


def target_met(target: Optional[float], score: float) -> Optional[bool]:
    return None if target is None else score >= target

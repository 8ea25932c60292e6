"""The benchmark's statistics: throughput over the steady epochs, medians, step times, the bound and the
ideal of a communication-bound step, and the steps_per_execution overhead fit."""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

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


BOUND_KEYS = ("t_forward_ms", "t_backward_ms", "t_comm_ms", "bound_ms")


def bound_figures(runs: list[dict]) -> dict:
    """The medians over runs of what comm_mlp.py --measure_bound reported (each run's own after its fit):
    t_forward, t_backward, t_comm and bound = t_forward + max(t_backward, t_comm), and each run's bound."""
    missing = [k for k in BOUND_KEYS if any(k not in m for m in runs)]
    if missing:
        raise RuntimeError(f"a bound-scored row's runs reported no {missing} (comm_mlp.py --measure_bound)")
    figures = {k: round(statistics.median(m[k] for m in runs), 2) for k in BOUND_KEYS}
    return {**figures, "bound_ms_per_run": [m["bound_ms"] for m in runs]}


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


def scaling_model(rows: list[dict], workers: Sequence[int] = (2, 4, 8, 16, 32, 64),
                  rates: Sequence[str] = ("10gbit", "100gbit")) -> dict:
    """Projected weak-scaling efficiency of the comm MLP from the comm rows' measurements.

    Calibrated on this machine: compute per step t_c (comm_mwms's compute-alone
    side, per worker at batch 512) and the link's efficiency eta, the nominal
    over the measured time to move a step's gradients on 2 workers (comm_mwms's
    step less t_c, against bytes x 2 / rate). On a cluster each worker has its
    own link of rate R, and a ring all-reduce sends 2 (N - 1) / N x G bytes a
    worker, so t_comm(N) = 2 (N - 1) / N x G x 8 / (R x eta). Efficiency is
    t_c over the step: without overlap t_c + t_comm; with ideal overlap of the
    backward pass (two thirds of t_c) t_c / 3 + max(2 t_c / 3, t_comm);
    bfloat16 all-reduce halves G. It is checked against the rows it was not
    fitted to: the bf16 and accumulation steps on 2 workers at the emulated rate, predicted from t_c and the
    measured transfer time (both workers' bytes on the one link, as calibrated; bf16: half of it).
    """
    by_name = {r["row"]: r for r in rows}
    if "comm_mwms" not in by_name:
        return {}
    row = by_name["comm_mwms"]
    extra = row["extra"]
    compute, gradient_bytes = extra["compute_ms"], extra["gradient_bytes"]
    measured_comm = max(1e-9, row["a_step_ms"] - compute)
    eta = extra["comm_ms"] / measured_comm

    def comm_ms(n: int, rate: str, dtype_bytes: int = 4) -> float:
        return 1000 * 2 * (n - 1) / n * gradient_bytes * dtype_bytes / 4 * 8 / (parse_rate(rate) * eta)

    def efficiency(n: int, rate: str, overlap: bool, dtype_bytes: int) -> float:
        t = comm_ms(n, rate, dtype_bytes)
        step = compute / 3 + max(2 * compute / 3, t) if overlap else compute + t
        return round(compute / step, 3)

    table = {rate: {f"{'overlap' if o else 'serial'}_{'bf16' if d == 2 else 'fp32'}":
                    {str(n): efficiency(n, rate, o, d) for n in workers}
                    for o in (False, True) for d in (4, 2)} for rate in rates}
    checks = {"comm_mwms_step_ms": {"predicted": round(compute + measured_comm, 1), "measured": row["a_step_ms"]}}
    if "comm_bf16" in by_name:
        checks["comm_bf16_step_ms"] = {"predicted": round(compute + measured_comm / 2, 1),
                                       "measured": by_name["comm_bf16"]["a_step_ms"]}
    if "comm_accum" in by_name:
        k = by_name["comm_accum"]["a"]["global_batch_size"] // by_name["comm_accum"]["b"]["global_batch_size"]
        checks["comm_accum_step_ms"] = {"predicted": round(k * compute + measured_comm, 1),
                                        "measured": by_name["comm_accum"]["a_step_ms"], "k": k}
    return {"compute_ms": compute, "gradient_bytes": gradient_bytes, "link_efficiency": round(eta, 3),
            "efficiency": table, "checks": checks}


def scaling_table(model: dict) -> str:
    """The README's scaling table: efficiency by worker count, per rate and mode."""
    if not model:
        return ""
    counts = list(next(iter(next(iter(model["efficiency"].values())).values())))
    lines = ["| link | mode | " + " | ".join(f"{n} workers" for n in counts) + " |",
             "| --- | --- | " + " | ".join("---" for _ in counts) + " |"]
    for rate, modes in model["efficiency"].items():
        for mode, values in modes.items():
            lines.append(f"| {rate} | {mode.replace('_', ', ')} | " + " | ".join(f"{v:.2f}" for v in values.values())
                         + " |")
    return "\n".join(lines)

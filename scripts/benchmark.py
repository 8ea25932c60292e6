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

It writes OUT_DIR/benchmark.json (every raw measurement, medians, min/max,
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
             float32 (ar_bf16), --all_reduce_pack_mb=0.25 vs 0, TensorFlow's default (ar_pack).
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
GPU rows (only where GPUs are found, or --gpus=N):
  gpu        gpu_fit (1 GPU: tfdist vs model.fit), gpu_bf16 and gpu_fp16 (vs float32), gpu_xla (XLA on vs
             off), gpu_mirrored (N GPUs mirrored vs 1 GPU, same global batch; needs N >= 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPE_SWEEP = (1, 2, 5, 10, 20, 50)
CPU_GROUPS = ("fit", "input", "bf16", "jit", "mwms", "allreduce", "ps", "ps_embedding", "horovod", "hvd_fp16",
              "hvd_cycle", "spe")
GPU_GROUPS = ("gpu",)
GPU_ROWS = ("gpu_fit", "gpu_bf16", "gpu_fp16", "gpu_xla", "gpu_mirrored")
HOROVOD_GROUPS = ("horovod", "hvd_fp16", "hvd_cycle")
# Targets set in the project's issue 11: ratio of the medians (A over B) a row should reach.
TARGETS = {"fit": 1.25, "input": 0.95, "mwms": 0.80, "ps": 0.75, "horovod": 0.90,
           # The ShardedEmbedding rows: >= 20x Keras' Embedding; a 1M-row table's step within 1.25x of a 10k one's.
           "sharded_vs_keras_sgd": 20.0, "sharded_vs_keras_adagrad": 20.0, "rows_1m_vs_10k": 0.80}
# ps_embedding: batch, table and steps per epoch, in multiples of steps_per_execution (two or more executions
# an epoch, so both workers of the job have one in flight).
PS_EMB_BATCH, PS_EMB_DIM, PS_EMB_ROWS, PS_EMB_SMALL_ROWS = 1024, 64, 1_000_000, 10_000
PS_EMB_EXECUTIONS, PS_EMB_KERAS_EXECUTIONS = 5, 2  # Keras' Embedding: ~0.4-0.5 s a step on a 2-core CPU.
PS_EMB_LEARNING_RATE = 0.05

MATPLOTLIB_MISSING = (
    "scripts/benchmark.py draws its chart with matplotlib, which this Python ({python}) cannot import. "
    "matplotlib is needed only by the benchmark, so it is an optional extra: install it with "
    "`pip install 'tfdist[bench]'` (or `pip install 'matplotlib>=3.7'`) in this environment, or pass "
    "--no_chart to write benchmark.json alone. Nothing was measured yet."
)


# Rows -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Side:
    """One side of a row: a program, its flags, how it is launched and on which devices."""

    label: str
    program: str  # "tfdist" (tfdist-train), "keras" (scripts/keras_fit_baseline.py) or "ps_embedding"
    #               (scripts/ps_embedding.py, the ps_embedding rows).
    flags: tuple[str, ...]
    launcher: tuple[str, ...] = ()  # ("launch", "2") | ("launch_ps", "2", "1") | ("horovodrun", "2") | ().
    python: Optional[str] = None  # Default: this script's interpreter.
    visible_gpus: str = ""  # CUDA_VISIBLE_DEVICES: "" pins a side to the CPU.
    env: tuple[tuple[str, str], ...] = ()  # Extra environment variables for this side.

    def command(self, workdir: str) -> list[str]:
        python = self.python or sys.executable
        if self.program == "keras":
            program = [python, os.path.join(REPO, "scripts", "keras_fit_baseline.py")]
        elif self.program == "ps_embedding":
            program = [python, os.path.join(REPO, "scripts", "ps_embedding.py"), f"--workdir={workdir}"]
        else:
            program = [python, "-m", "tfdist.cli.train", f"--workdir={workdir}"]
        return [*launcher_command(self.launcher, python), *program, *self.flags]


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    group: str  # The name --rows selects it by.
    title: str
    a: Side
    b: Side
    device: str = "cpu"
    spe: Optional[int] = None  # Set on the points of the steps_per_execution sweep.

    @property
    def target(self) -> Optional[float]:
        return TARGETS.get(self.name)


def launcher_command(launcher: Sequence[str], python: str) -> list[str]:
    if not launcher:
        return []
    kind, *numbers = launcher
    if kind == "launch":
        return [python, "-m", "tfdist.cli.launch", f"--num_workers={numbers[0]}", "--"]
    if kind == "launch_ps":
        return [python, "-m", "tfdist.cli.launch", f"--num_workers={numbers[0]}", f"--num_ps={numbers[1]}", "--"]
    if kind == "horovodrun":
        horovodrun = os.path.join(os.path.dirname(python), "horovodrun")
        return [horovodrun, "-np", numbers[0], "-H", f"localhost:{numbers[0]}", "--gloo"]
    raise ValueError(f"unknown launcher {launcher!r}")


@dataclasses.dataclass(frozen=True)
class Settings:
    epochs: int = 4
    batch: int = 128
    precision: str = "float32"
    steps_per_execution: int = 10
    learning_rate: float = 3e-3  # Passed to both sides, so a change of either program's default cannot skew a row.
    lr_schedule: str = "cosine"
    horovod_python: Optional[str] = None

    def schedule_flags(self) -> tuple[str, ...]:
        return (f"--learning_rate={self.learning_rate:g}", f"--lr_schedule={self.lr_schedule}")


def _tfdist(label: str, *flags: str, settings: Settings, strategy: str = "default", precision: Optional[str] = None,
            spe: Optional[int] = None, **side: object) -> Side:
    return Side(label, "tfdist", (f"--strategy={strategy}", f"--global_batch_size={settings.batch}",
                                  f"--epochs={settings.epochs}", f"--precision={precision or settings.precision}",
                                  f"--steps_per_execution={spe or settings.steps_per_execution}",
                                  *settings.schedule_flags(), *flags), **side)


def _keras(label: str, *flags: str, settings: Settings, precision: Optional[str] = None, spe: Optional[int] = None,
           **side: object) -> Side:
    return Side(label, "keras", (f"--batch_size={settings.batch}", f"--epochs={settings.epochs}",
                                 f"--precision={precision or settings.precision}",
                                 f"--steps_per_execution={spe or settings.steps_per_execution}",
                                 *settings.schedule_flags(), *flags), **side)


def _ps_embedding(label: str, layer: str, optimizer: str, *, settings: Settings, rows: int = PS_EMB_ROWS) -> Side:
    """A side of the ps_embedding rows: scripts/ps_embedding.py under 2 workers + 2 ps tasks."""
    spe = settings.steps_per_execution
    steps = spe * (PS_EMB_KERAS_EXECUTIONS if layer == "keras" else PS_EMB_EXECUTIONS)
    return Side(label, "ps_embedding", (f"--layer={layer}", f"--rows={rows}", f"--dim={PS_EMB_DIM}",
                                        f"--optimizer={optimizer}", f"--learning_rate={PS_EMB_LEARNING_RATE:g}",
                                        f"--batch={PS_EMB_BATCH}", f"--steps_per_epoch={steps}",
                                        f"--epochs={settings.epochs}", f"--steps_per_execution={spe}"),
                launcher=("launch_ps", "2", "2"))


def _ps_embedding_rows(s: Settings) -> list[Row]:
    table = f"{PS_EMB_ROWS:,} x {PS_EMB_DIM}"
    rows = [Row(f"sharded_vs_keras_{opt}", "ps_embedding",
                f"2 ps + 2 workers, {table} table, {name}: ShardedEmbedding vs keras Embedding",
                _ps_embedding(f"ShardedEmbedding ({name})", "sharded", opt, settings=s),
                _ps_embedding(f"keras Embedding ({name})", "keras", opt, settings=s))
            for opt, name in (("sgd", "SGD"), ("adagrad", "Adagrad"))]
    rows.append(Row("rows_1m_vs_10k", "ps_embedding",
                    f"2 ps + 2 workers, ShardedEmbedding, SGD: {PS_EMB_ROWS:,} rows vs {PS_EMB_SMALL_ROWS:,} rows",
                    _ps_embedding(f"{PS_EMB_ROWS:,} rows", "sharded", "sgd", settings=s),
                    _ps_embedding(f"{PS_EMB_SMALL_ROWS:,} rows", "sharded", "sgd", settings=s,
                                  rows=PS_EMB_SMALL_ROWS)))
    return rows


def _cpu_rows(group: str, s: Settings) -> list[Row]:
    mwms = "multi_worker_mirrored"
    hvd = {"python": s.horovod_python}
    spe = s.steps_per_execution
    rows = {
        "fit": lambda: [Row("fit", "fit", f"tfdist-train vs Keras model.fit (steps_per_execution={spe})",
                            _tfdist("tfdist-train", settings=s), _keras("model.fit", settings=s))],
        "input": lambda: [Row("input", "input", "bundled digits vs synthetic data",
                              _tfdist("real digits", settings=s),
                              _tfdist("synthetic", "--dataset=synthetic", settings=s))],
        "bf16": lambda: [Row("bf16", "bf16", "mixed_bfloat16 vs float32",
                             _tfdist("mixed_bfloat16", settings=s, precision="mixed_bfloat16"),
                             _tfdist("float32", settings=s, precision="float32"))],
        "jit": lambda: [Row("jit", "jit", "XLA (--jit_compile=true) vs off",
                            _tfdist("XLA on", "--jit_compile=true", settings=s),
                            _tfdist("XLA off", "--jit_compile=false", settings=s))],
        "mwms": lambda: [Row("mwms", "mwms", "MWMS 2 workers vs 1 worker, same global batch",
                             _tfdist("2 workers", settings=s, strategy=mwms, launcher=("launch", "2")),
                             _tfdist("1 worker", settings=s, strategy=mwms))],
        "allreduce": lambda: [Row("allreduce", "allreduce", "MWMS 2 workers: --all_reduce=ring vs auto",
                                  _tfdist("ring", "--all_reduce=ring", settings=s, strategy=mwms,
                                          launcher=("launch", "2")),
                                  _tfdist("auto", "--all_reduce=auto", settings=s, strategy=mwms,
                                          launcher=("launch", "2"))),
                              Row("ar_bf16", "allreduce", "MWMS 2 workers: bfloat16 all-reduce vs float32",
                                  _tfdist("bfloat16", "--all_reduce_dtype=bfloat16", settings=s, strategy=mwms,
                                          launcher=("launch", "2")),
                                  _tfdist("float32", "--all_reduce_dtype=float32", settings=s, strategy=mwms,
                                          launcher=("launch", "2"))),
                              Row("ar_pack", "allreduce", "MWMS 2 workers: gradients packed by 0.25 MB vs TF default",
                                  _tfdist("0.25 MB packs", "--all_reduce_pack_mb=0.25", settings=s, strategy=mwms,
                                          launcher=("launch", "2")),
                                  _tfdist("default", "--all_reduce_pack_mb=0", settings=s, strategy=mwms,
                                          launcher=("launch", "2")))],
        "ps": lambda: [Row("ps", "ps", "1 ps + 2 workers vs 1 local worker, same global batch",
                           _tfdist("1 ps + 2 workers", settings=s, strategy="parameter_server",
                                   launcher=("launch_ps", "2", "1")),
                           _tfdist("1 worker", settings=s))],
        "ps_embedding": lambda: _ps_embedding_rows(s),
        "horovod": lambda: [Row("horovod", "horovod", "Horovod 2 ranks vs MWMS 2 workers (same TF)",
                                _tfdist("Horovod 2 ranks", settings=s, strategy="horovod",
                                        launcher=("horovodrun", "2"), **hvd),
                                _tfdist("MWMS 2 workers", settings=s, strategy=mwms, launcher=("launch", "2"),
                                        **hvd))],
        "hvd_fp16": lambda: [Row("hvd_fp16", "hvd_fp16", "Horovod 2 ranks: fp16 compression vs none",
                                 _tfdist("fp16", "--hvd_compression=fp16", settings=s, strategy="horovod",
                                         launcher=("horovodrun", "2"), **hvd),
                                 _tfdist("none", "--hvd_compression=none", settings=s, strategy="horovod",
                                         launcher=("horovodrun", "2"), **hvd))],
        "hvd_cycle": lambda: [Row("hvd_cycle", "hvd_cycle", "Horovod 2 ranks: HOROVOD_CYCLE_TIME 0.2 ms vs default",
                                  _tfdist("0.2 ms", settings=s, strategy="horovod", launcher=("horovodrun", "2"),
                                          env=(("HOROVOD_CYCLE_TIME", "0.2"),), **hvd),
                                  _tfdist("default (1 ms)", settings=s, strategy="horovod",
                                          launcher=("horovodrun", "2"), **hvd))],
        "spe": lambda: [Row(f"spe{n}", "spe", f"tfdist-train vs model.fit at steps_per_execution={n}",
                            _tfdist("tfdist-train", settings=s, spe=n), _keras("model.fit", settings=s, spe=n),
                            spe=n) for n in SPE_SWEEP],
    }
    return rows[group]()


def _gpu_rows(gpus: int, s: Settings) -> list[Row]:
    one = {"visible_gpus": "0"}
    rows = [
        Row("gpu_fit", "gpu", "1 GPU: tfdist-train vs model.fit", _tfdist("tfdist-train", settings=s, **one),
            _keras("model.fit", settings=s, **one), device="gpu"),
        Row("gpu_bf16", "gpu", "1 GPU: mixed_bfloat16 vs float32",
            _tfdist("mixed_bfloat16", settings=s, precision="mixed_bfloat16", **one),
            _tfdist("float32", settings=s, precision="float32", **one), device="gpu"),
        Row("gpu_fp16", "gpu", "1 GPU: mixed_float16 vs float32",
            _tfdist("mixed_float16", settings=s, precision="mixed_float16", **one),
            _tfdist("float32", settings=s, precision="float32", **one), device="gpu"),
        Row("gpu_xla", "gpu", "1 GPU: XLA on vs off", _tfdist("XLA on", "--jit_compile=true", settings=s, **one),
            _tfdist("XLA off", "--jit_compile=false", settings=s, **one), device="gpu"),
    ]
    if gpus >= 2:
        rows.append(Row("gpu_mirrored", "gpu", f"{gpus} GPUs mirrored vs 1 GPU, same global batch",
                        _tfdist(f"{gpus} GPUs", f"--num_gpus={gpus}", settings=s, strategy="mirrored",
                                visible_gpus=",".join(str(i) for i in range(gpus))),
                        _tfdist("1 GPU", settings=s, **one), device="gpu"))
    return rows


def expand(requested: Sequence[str]) -> list[str]:
    """Row groups in run order; "all" means every group. Unknown names raise ValueError listing the valid ones."""
    names = [r.strip() for r in requested if r.strip()]
    if "all" in names:
        names = list(CPU_GROUPS + GPU_GROUPS)
    unknown = [n for n in names if n not in CPU_GROUPS + GPU_GROUPS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; valid rows: all, {', '.join(CPU_GROUPS + GPU_GROUPS)}")
    return list(dict.fromkeys(names))


def select_rows(requested: Sequence[str], gpus: int, settings: Settings = Settings()) -> list[Row]:
    """The rows to measure: the requested groups this machine can run (GPU rows only with GPUs,
    gpu_mirrored only with 2 or more, Horovod rows only with settings.horovod_python)."""
    rows: list[Row] = []
    for group in expand(requested):
        if group in HOROVOD_GROUPS and not settings.horovod_python:
            continue
        if group == "gpu":
            rows += _gpu_rows(gpus, settings) if gpus > 0 else []
        else:
            rows += _cpu_rows(group, settings)
    return rows


def skipped_groups(requested: Sequence[str], gpus: int, settings: Settings) -> dict[str, str]:
    why = {}
    for group in expand(requested):
        if group in HOROVOD_GROUPS and not settings.horovod_python:
            why[group] = ("no Python with horovod (horovodrun beside it) was given; pass "
                          "--horovod_python=.nox/tests-tf2-18-horovod/bin/python")
        if group == "gpu" and gpus < 1:
            why[group] = "no GPU found (nvidia-smi -L lists none); --gpus=N forces N"
    return why


# Machine --------------------------------------------------------------------------
def count_gpus() -> int:
    """NVIDIA GPUs nvidia-smi lists (0 without it); TensorFlow is not imported for this."""
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _version(package: str, python: Optional[str] = None) -> Optional[str]:
    # Not realpath: venvs' pythons link to one interpreter but see different site-packages.
    if python and os.path.abspath(python) != os.path.abspath(sys.executable):
        code = f"import importlib.metadata as m; print(m.version({package!r}))"
        result = subprocess.run([python, "-c", code], capture_output=True, text=True)
        return result.stdout.strip() or None
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_facts(gpus: int, settings: Settings) -> dict:
    model, flags, ids = None, [], {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model is None:
                    model = line.split(":", 1)[1].strip()
                for key in ("cpu family", "model", "stepping"):
                    if line.split(":")[0].strip() == key:
                        ids.setdefault(key, line.split(":", 1)[1].strip())
                if line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    facts = {
        "cpu_model": model or platform.processor() or platform.machine(),
        "cpu_id": ", ".join(f"{k} {v}" for k, v in ids.items()),
        "cpu_cores": os.cpu_count(),
        "cpu_bf16_flags": sorted(set(flags) & {"amx_bf16", "avx512_bf16"}),
        "gpus": gpus,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": _version("tensorflow"),
        "keras": _version("keras"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if gpus and shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        facts["gpu_models"] = [line.split(":", 1)[1].split("(")[0].strip() for line in out.splitlines()
                               if line.startswith("GPU ")]
    if settings.horovod_python:
        facts["horovod_python"] = settings.horovod_python
        facts["horovod_tensorflow"] = _version("tensorflow", settings.horovod_python)
        facts["horovod"] = _version("horovod", settings.horovod_python)
    return facts


# Measuring ------------------------------------------------------------------------
def steady_throughput(metrics: dict) -> float:
    """Examples per second over epochs 2..N (all epochs if there is only one)."""
    seconds = metrics["epoch_train_seconds"][1:] or metrics["epoch_train_seconds"]
    return len(seconds) * metrics["steps_per_epoch"] * metrics["global_batch_size"] / sum(seconds)


def _env(side: Side) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["CUDA_VISIBLE_DEVICES"] = side.visible_gpus
    env.pop("TF_CONFIG", None)
    for name in ("HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD"):  # Only where a row sets them.
        env.pop(name, None)
    env.update(dict(side.env))
    return env


def run_side(side: Side) -> dict:
    """Runs one side once in fresh processes; returns its metrics (tfdist's metrics.json or the baseline's JSON)."""
    with tempfile.TemporaryDirectory(prefix="tfdist-bench-") as tmp:
        workdir = os.path.join(tmp, "w")
        cmd = side.command(workdir)
        start = time.perf_counter()
        result = subprocess.run(cmd, capture_output=True, text=True, env=_env(side), cwd=REPO)
        if result.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-3000:]}"
                               f"\n{result.stdout[-2000:]}")
        if side.program == "keras":
            metrics = json.loads(result.stdout.strip().splitlines()[-1])
        else:
            with open(os.path.join(workdir, "metrics.json")) as f:
                metrics = json.load(f)
        metrics["process_seconds"] = round(time.perf_counter() - start, 2)
        return metrics


def _summary(side: Side, runs: list[dict]) -> dict:
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
        "tensorflow_version": runs[0].get("tensorflow_version"),
        "precision": runs[0].get("precision"),
        "dataset": runs[0].get("dataset", "mnist"),
    }


def _step_ms(metrics: dict) -> float:
    seconds = metrics["epoch_train_seconds"][1:] or metrics["epoch_train_seconds"]
    return 1000 * sum(seconds) / (len(seconds) * metrics["steps_per_epoch"])


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
    compute = statistics.median(_step_ms(m) for m in half)
    full = statistics.median(_step_ms(m) for m in a_runs)
    return {"one_worker_half_batch_step_ms": round(compute, 3), "two_worker_step_ms": round(full, 3),
            "communication_share_estimate": round(max(0.0, 1 - compute / full), 3)}


def step_times(row: Row, a_runs: list[dict], b_runs: list[dict]) -> dict:
    """Median milliseconds per training step on each side (steady epochs)."""
    return {"a_step_ms": round(statistics.median(_step_ms(m) for m in a_runs), 3),
            "b_step_ms": round(statistics.median(_step_ms(m) for m in b_runs), 3)}


EXTRAS = {"mwms": extra_mwms}


def measure(row: Row, repeats: int, run: Callable[[Side], dict] = run_side) -> dict:
    a_runs, b_runs = [], []
    for _ in range(repeats):  # Alternate, so drift on a shared machine hits both sides.
        a_runs.append(run(row.a))
        b_runs.append(run(row.b))
    a, b = _summary(row.a, a_runs), _summary(row.b, b_runs)
    ratio = a["median"] / b["median"]
    result = {
        "row": row.name, "group": row.group, "title": row.title, "device": row.device, "spe": row.spe,
        "a": a, "b": b, "ratio_a_over_b": round(ratio, 3),
        "ratio_min_max": [round(a["min"] / b["max"], 3), round(a["max"] / b["min"], 3)],
        "target": row.target, "target_met": None if row.target is None else ratio >= row.target,
        **step_times(row, a_runs, b_runs),
    }
    if row.name in EXTRAS:
        result["extra"] = EXTRAS[row.name](row, a_runs, repeats, run)
    return result


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


# Chart ----------------------------------------------------------------------------
def import_pyplot():
    """matplotlib's pyplot on the Agg backend, or SystemExit with one paragraph saying how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(MATPLOTLIB_MISSING.format(python=sys.executable)) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(report: dict, path: str) -> None:
    """Bars per row (both sides, min/max whiskers) and examples/s against steps_per_execution."""
    plt = import_pyplot()
    rows = [r for r in report["rows"] if r["spe"] is None]
    sweep = sorted((r for r in report["rows"] if r["spe"] is not None), key=lambda r: r["spe"])
    panels = [p for p, present in (("bars", rows), ("sweep", sweep)) if present]
    fig, axes = plt.subplots(1, len(panels) or 1, figsize=(7 * max(1, len(panels)), 1.2 + 0.75 * max(4, len(rows))),
                             squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "bars":
            ys = range(len(rows))
            for offset, side, color in ((-0.2, "a", "tab:blue"), (0.2, "b", "tab:gray")):
                med = [r[side]["median"] for r in rows]
                err = [[r[side]["median"] - r[side]["min"] for r in rows],
                       [r[side]["max"] - r[side]["median"] for r in rows]]
                ax.barh([y + offset for y in ys], med, height=0.38, xerr=err, color=color, capsize=3,
                        label="A (first side)" if side == "a" else "B (second side)")
                for y, r in zip(ys, rows):
                    ax.text(r[side]["median"] * 0.02, y + offset, r[side]["label"], va="center", fontsize=7,
                            color="white" if side == "a" else "black")
            ax.set_yticks(list(ys))
            ax.set_yticklabels([f"{r['row']}\n{r['ratio_a_over_b']:.2f}x"
                                + (f" (target {r['target']:.2f})" if r["target"] else "") for r in rows],
                               fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel("training examples/s (median, whiskers min-max)")
            ax.set_title("A vs B per row")
            ax.legend(fontsize=7, loc="lower right")
        else:
            x = [r["spe"] for r in sweep]
            for side, name, color in (("a", "tfdist-train", "tab:blue"), ("b", "Keras model.fit", "tab:orange")):
                med = [r[side]["median"] for r in sweep]
                err = [[r[side]["median"] - r[side]["min"] for r in sweep],
                       [r[side]["max"] - r[side]["median"] for r in sweep]]
                ax.errorbar(x, med, yerr=err, marker="o", capsize=3, label=name, color=color)
            ax.set_xscale("log")
            ax.set_xticks(x)
            ax.set_xticklabels([str(v) for v in x])
            ax.set_xlabel("steps_per_execution")
            ax.set_ylabel("training examples/s (median, min-max)")
            ax.set_title("examples/s against steps_per_execution")
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    m = report["machine"]
    s = report["settings"]
    fig.suptitle(f"{m['cpu_model']}, {m['cpu_cores']} cores, {m['gpus']} GPU(s); TF {m['tensorflow']}, "
                 f"Keras {m['keras']}; batch {s['batch']}, {s['precision']}, {s['epochs']} epochs, "
                 f"{s['repeats']} alternating runs a side; {m['date'][:10]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(report: dict) -> str:
    """The README's table: one line per row, ratio of medians and both sides' median (min-max)."""
    def side(s: dict) -> str:
        return f"{s['label']}: {s['median'] / 1000:.2f}k ({s['min'] / 1000:.2f}-{s['max'] / 1000:.2f}k)"

    lines = ["| row | A / B (ratio of medians) | A examples/s, median (min-max) | B examples/s, median (min-max) "
             "| target |", "| --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        target = "" if r["target"] is None else f">= {r['target']:.2f}: {'met' if r['target_met'] else '**not met**'}"
        lines.append(f"| `{r['row']}` {r['title']} | {r['ratio_a_over_b']:.2f}x | {side(r['a'])} | {side(r['b'])} "
                     f"| {target} |")
    return "\n".join(lines)


# Main -----------------------------------------------------------------------------
def _print_row(result: dict) -> None:
    a, b = result["a"], result["b"]
    target = ""
    if result["target"] is not None:
        target = f"  target >= {result['target']:.2f}: {'met' if result['target_met'] else 'NOT met'}"
    print(f"{result['row']:>12}: {a['label']} / {b['label']} = {result['ratio_a_over_b']:.3f}  "
          f"(examples/s {a['examples_per_sec']} vs {b['examples_per_sec']}; eval accuracy "
          f"{a['eval_accuracy']} vs {b['eval_accuracy']}; ms/step {result['a_step_ms']} vs {result['b_step_ms']})"
          f"{target}"
          + (f" {result['extra']}" if "extra" in result else ""), flush=True)


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
              "skipped": skipped, "failed": [], "rows": []}
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, "benchmark.json")
    for row in rows:
        try:
            result = measure(row, args.repeats, run)
        except RuntimeError as e:  # One broken row must not cost the others' measurements.
            report["failed"].append({"row": row.name, "error": str(e)[-4000:]})
            print(f"{row.name:>12}: FAILED {str(e)[-1500:]}", flush=True)
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
    report["duration_seconds"] = round(time.perf_counter() - start, 1)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {json_path} ({report['duration_seconds']:.0f} s)", flush=True)
    print(markdown_table(report), flush=True)
    if not args.no_chart and report["rows"]:
        png = os.path.join(args.out_dir, "benchmark.png")
        draw(report, png)
        print(f"wrote {png}", flush=True)
    return report


if __name__ == "__main__":
    main()

"""The benchmark's rows: two sides each, declared as data; which rows a machine gets.

A `Side` is one program with its flags, how it is launched (alone, under
tfdist-launch with or without a shaped link, under horovodrun, or as N
independent copies at once) and on which devices. A `Row` is two sides, and
its target: the ratio of the medians (A over B) it should reach, or, for a row
scored against a bound (comm_mwms), the bound A's own processes measured over
A's measured step time.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPE_SWEEP = (1, 2, 5, 10, 20, 50)
CPU_GROUPS = ("fit", "input", "bf16", "jit", "mwms", "allreduce", "ps", "ps_embedding", "horovod", "hvd_fp16",
              "hvd_cycle", "spe", "peers", "comm")
GPU_GROUPS = ("gpu",)
GPU_ROWS = ("gpu_fit", "gpu_bf16", "gpu_fp16", "gpu_xla", "gpu_mirrored")
HOROVOD_GROUPS = ("horovod", "hvd_fp16", "hvd_cycle")
# What a row should reach (issues 11, 17 and 21): ratio of the medians, A over B; for comm_mwms the bound
# t_forward + max(t_backward, t_comm), measured in the same run, over the measured step: the step within
# COMM_BOUND_SLACK of it. fit: never slower than Keras' own fit; peers: >= 1.10x each; comm_ps (shaped link or
# not): never slower than tf_keras.
COMM_BOUND_SLACK = 1.10
TARGETS = {"fit": 1.0, "input": 0.95, "mwms": 0.80, "ps": 0.75, "horovod": 0.90,
           "sharded_vs_keras_sgd": 20.0, "sharded_vs_keras_adagrad": 20.0, "rows_1m_vs_10k": 0.80,
           "peer_mwms": 1.10, "peer_ps": 1.10, "peer_mirrored": 1.10, "peer_horovod": 1.10,
           "comm_mwms": 1 / COMM_BOUND_SLACK, "comm_tf_keras": 1.30, "comm_bf16": 1.50, "comm_ps": 1.0,
           "comm_ps_unshaped": 1.0}
# ps_embedding: batch, table and steps per epoch, in multiples of steps_per_execution (two or more executions
# an epoch, so both workers of the job have one in flight).
PS_EMB_BATCH, PS_EMB_DIM, PS_EMB_ROWS, PS_EMB_SMALL_ROWS = 1024, 64, 1_000_000, 10_000
PS_EMB_EXECUTIONS, PS_EMB_KERAS_EXECUTIONS = 5, 2  # Keras' Embedding: ~0.4-0.5 s a step on a 2-core CPU.
PS_EMB_LEARNING_RATE = 0.05
# comm: scripts/comm_mlp.py (512 -> 3 x 1024 -> 10, 2.63M float32 weights: 10.5 MB of gradients a step), global
# batch 1024, on a loopback shaped to COMM_RATE. At 1 Gbit/s moving a step's gradients (x 2: both workers' ring
# traffic shares the link) takes 169 ms; computing the step on one of the 2 cores about 110 ms.
COMM_RATE, COMM_BATCH, COMM_STEPS, COMM_SPE, COMM_ACCUM = "1gbit", 1024, 8, 4, 4
COMM_EXAMPLES = COMM_BATCH * COMM_ACCUM * COMM_STEPS  # One epoch of the accumulating side; every side reads them.
PROGRAMS = {  # Side.program -> script (None: tfdist-train).
    "tfdist": None, "keras": "keras_fit_baseline.py", "ps_embedding": "ps_embedding.py",
    "peer_tf_keras": "peer_tf_keras.py", "peer_horovod": "peer_horovod_keras.py", "comm_mlp": "comm_mlp.py"}
WRITES_METRICS = ("tfdist", "ps_embedding")  # Programs that write WORKDIR/metrics.json; the others print BENCH JSON.


@dataclasses.dataclass(frozen=True)
class Side:
    """One side of a row: a program, its flags, how it is launched and on which devices."""

    label: str
    program: str  # A key of PROGRAMS.
    flags: tuple[str, ...]
    # () | ("launch", N) | ("launch_ps", N, PS) | ("horovodrun", N) | ("parallel", N): N copies at once, no TF_CONFIG.
    launcher: tuple[str, ...] = ()
    python: Optional[str] = None  # Default: the benchmark's interpreter.
    visible_gpus: str = ""  # CUDA_VISIBLE_DEVICES: "" pins a side to the CPU.
    env: tuple[tuple[str, str], ...] = ()  # Extra environment variables for this side.
    link_rate: Optional[str] = None  # tfdist-launch --link_rate (launch and launch_ps only).

    def command(self, workdir: str) -> list[str]:
        python = self.python or sys.executable
        script = PROGRAMS[self.program]
        if script is None:
            program = [python, "-m", "tfdist.cli.train", f"--workdir={workdir}"]
        else:
            program = [python, os.path.join(REPO, "scripts", script)]
            if self.program == "ps_embedding":
                program.append(f"--workdir={workdir}")
        return [*launcher_command(self.launcher, python, self.link_rate), *program, *self.flags]


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    group: str  # The name --rows selects it by.
    title: str
    a: Side
    b: Side
    device: str = "cpu"
    spe: Optional[int] = None  # Set on the points of the steps_per_execution sweep.
    score: str = "ratio"  # "ratio": A over B; "bound": the bound A's runs measured over A's step (comm_mwms).

    @property
    def target(self) -> Optional[float]:
        return TARGETS.get(self.name)


def launcher_command(launcher: Sequence[str], python: str, link_rate: Optional[str] = None) -> list[str]:
    if not launcher or launcher[0] == "parallel":  # "parallel": the runner starts the copies.
        return []
    kind, *numbers = launcher
    shaped = [f"--link_rate={link_rate}"] if link_rate else []
    if kind == "launch":
        return [python, "-m", "tfdist.cli.launch", f"--num_workers={numbers[0]}", *shaped, "--"]
    if kind == "launch_ps":  # --grace_s=3: the peers' servers join forever (as TensorFlow's tutorial writes them).
        return [python, "-m", "tfdist.cli.launch", f"--num_workers={numbers[0]}", f"--num_ps={numbers[1]}",
                "--grace_s=3", *shaped, "--"]
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

    def schedule_flags(self, schedule: Optional[str] = None) -> tuple[str, ...]:
        return (f"--learning_rate={self.learning_rate:g}", f"--lr_schedule={schedule or self.lr_schedule}")


# Sides ----------------------------------------------------------------------------
def _tfdist(label: str, *flags: str, settings: Settings, strategy: str = "default", precision: Optional[str] = None,
            spe: Optional[int] = None, schedule: Optional[str] = None, **side: object) -> Side:
    return Side(label, "tfdist", (f"--strategy={strategy}", f"--global_batch_size={settings.batch}",
                                  f"--epochs={settings.epochs}", f"--precision={precision or settings.precision}",
                                  f"--steps_per_execution={spe or settings.steps_per_execution}",
                                  *settings.schedule_flags(schedule), *flags), **side)


def _keras(label: str, *flags: str, settings: Settings, precision: Optional[str] = None, spe: Optional[int] = None,
           schedule: Optional[str] = None, program: str = "keras", **side: object) -> Side:
    return Side(label, program, (f"--batch_size={settings.batch}", f"--epochs={settings.epochs}",
                                 f"--precision={precision or settings.precision}",
                                 f"--steps_per_execution={spe or settings.steps_per_execution}",
                                 *settings.schedule_flags(schedule), *flags), **side)


def _comm(label: str, *flags: str, settings: Settings, framework: str = "tfdist", batch: int = COMM_BATCH,
          launcher: tuple[str, ...] = ("launch", "2"), link_rate: Optional[str] = COMM_RATE, **side: object) -> Side:
    return Side(label, "comm_mlp", (f"--framework={framework}", f"--batch={batch}", f"--examples={COMM_EXAMPLES}",
                                    f"--steps_per_epoch={COMM_STEPS}", f"--epochs={settings.epochs}",
                                    f"--steps_per_execution={COMM_SPE}", *flags),
                launcher=launcher, link_rate=link_rate, **side)


def _ps_embedding(label: str, layer: str, optimizer: str, *, settings: Settings, rows: int = PS_EMB_ROWS) -> Side:
    """A side of the ps_embedding rows: scripts/ps_embedding.py under 2 workers + 2 ps tasks."""
    spe = settings.steps_per_execution
    steps = spe * (PS_EMB_KERAS_EXECUTIONS if layer == "keras" else PS_EMB_EXECUTIONS)
    return Side(label, "ps_embedding", (f"--layer={layer}", f"--rows={rows}", f"--dim={PS_EMB_DIM}",
                                        f"--optimizer={optimizer}", f"--learning_rate={PS_EMB_LEARNING_RATE:g}",
                                        f"--batch={PS_EMB_BATCH}", f"--steps_per_epoch={steps}",
                                        f"--epochs={settings.epochs}", f"--steps_per_execution={spe}"),
                launcher=("launch_ps", "2", "2"))


# Rows by group -----------------------------------------------------------------------
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


def _peer_rows(s: Settings) -> list[Row]:
    """tfdist-train against the program a user would write with a peer, on the same CNN, data and batch.

    Adam at a constant rate on both sides (tfdist's WarmupCosine is a Keras 3 schedule tf_keras cannot take).
    """
    mwms, const, spe = "multi_worker_mirrored", "constant", s.steps_per_execution
    hvd = {"python": s.horovod_python}
    rows = [
        Row("peer_mwms", "peers", f"MWMS 2 workers: tfdist-train vs tf_keras model.fit (spe {spe})",
            _tfdist("tfdist-train", settings=s, strategy=mwms, schedule=const, launcher=("launch", "2")),
            _keras("tf_keras fit", settings=s, schedule=const, program="peer_tf_keras", launcher=("launch", "2"))),
        Row("peer_ps", "peers", f"1 ps + 2 workers: tfdist-train vs tf_keras model.fit (spe {spe})",
            _tfdist("tfdist-train", settings=s, strategy="parameter_server", schedule=const,
                    launcher=("launch_ps", "2", "1")),
            _keras("tf_keras fit", settings=s, schedule=const, program="peer_tf_keras",
                   launcher=("launch_ps", "2", "1"))),
        Row("peer_mirrored", "peers", f"2 CPU replicas mirrored: tfdist-train (spe {spe}) vs Keras 3 model.fit "
            "(spe 1: the most it runs under MirroredStrategy, keras-team/keras#19246)",
            _tfdist("tfdist-train", "--num_cpu_replicas=2", settings=s, strategy="mirrored", schedule=const),
            _keras("Keras 3 fit (spe 1)", "--num_cpu_replicas=2", settings=s, schedule=const, spe=1)),
    ]
    if s.horovod_python:
        rows.append(Row("peer_horovod", "peers", "Horovod 2 ranks: tfdist-train vs horovod.tensorflow.keras + "
                        f"tf_keras (spe {spe})",
                        _tfdist("tfdist-train", settings=s, strategy="horovod", schedule=const,
                                launcher=("horovodrun", "2"), **hvd),
                        _keras("horovod.keras fit", settings=s, schedule=const, program="peer_horovod",
                               launcher=("horovodrun", "2"), **hvd)))
    return rows


def _comm_rows(s: Settings) -> list[Row]:
    """The communication-bound MLP on 2 workers over a loopback shaped to COMM_RATE (comm_ps_unshaped: not shaped).

    comm_mwms is scored against the bound its A side measures after fit in the same processes
    (comm_mlp.py --measure_bound); its B side, compute alone as 2 copies at half the batch, is informative and
    calibrates stats.scaling_model.
    """
    at = f"at {COMM_RATE}"
    half = COMM_BATCH // 2
    ps = ("launch_ps", "2", "1")
    return [
        Row("comm_mwms", "comm", f"MWMS 2 workers {at}: tfdist vs its bound t_forward + max(t_backward, t_comm)",
            _comm("tfdist, 2 workers", "--measure_bound", settings=s),
            _comm(f"compute alone: 2 copies at batch {half}", settings=s, batch=half, launcher=("parallel", "2"),
                  link_rate=None), score="bound"),
        Row("comm_tf_keras", "comm", f"MWMS 2 workers {at}: tfdist.fit vs tf_keras model.fit",
            _comm("tfdist.fit", settings=s), _comm("tf_keras fit", settings=s, framework="tf_keras")),
        Row("comm_bf16", "comm", f"MWMS 2 workers {at}: bfloat16 all-reduce vs float32",
            _comm("bfloat16 all-reduce", "--all_reduce_dtype=bfloat16", settings=s),
            _comm("float32 all-reduce", "--all_reduce_dtype=float32", settings=s)),
        Row("comm_accum", "comm", f"MWMS 2 workers {at}: {COMM_ACCUM} accumulated micro-batches of {COMM_BATCH} a "
            f"step vs 1 (one all-reduce per {COMM_ACCUM * COMM_BATCH} examples vs per {COMM_BATCH})",
            _comm(f"accumulate {COMM_ACCUM}", f"--grad_accum_steps={COMM_ACCUM}", settings=s,
                  batch=COMM_BATCH * COMM_ACCUM),
            _comm("no accumulation", settings=s)),
        Row("comm_ps", "comm", f"1 ps + 2 workers {at}: tfdist.fit vs tf_keras model.fit",
            _comm("tfdist.fit", settings=s, launcher=ps), _comm("tf_keras fit", settings=s, framework="tf_keras",
                                                                launcher=ps)),
        Row("comm_ps_unshaped", "comm", "1 ps + 2 workers, loopback not shaped: tfdist.fit vs tf_keras model.fit",
            _comm("tfdist.fit", settings=s, launcher=ps, link_rate=None),
            _comm("tf_keras fit", settings=s, framework="tf_keras", launcher=ps, link_rate=None)),
    ]


def _cpu_rows(group: str, s: Settings) -> list[Row]:
    mwms = "multi_worker_mirrored"
    hvd = {"python": s.horovod_python}
    spe = s.steps_per_execution
    two = {"strategy": mwms, "launcher": ("launch", "2")}
    horovod = {"strategy": "horovod", "launcher": ("horovodrun", "2"), **hvd}
    rows = {
        "fit": lambda: [Row("fit", "fit", f"tfdist-train vs Keras model.fit (steps_per_execution={spe})",
                            _tfdist("tfdist-train", settings=s), _keras("model.fit", settings=s))],
        "input": lambda: [Row("input", "input", "bundled digits vs synthetic data", _tfdist("real digits", settings=s),
                              _tfdist("synthetic", "--dataset=synthetic", settings=s))],
        "bf16": lambda: [Row("bf16", "bf16", "mixed_bfloat16 vs float32",
                             _tfdist("mixed_bfloat16", settings=s, precision="mixed_bfloat16"),
                             _tfdist("float32", settings=s, precision="float32"))],
        "jit": lambda: [Row("jit", "jit", "XLA (--jit_compile=true) vs off",
                            _tfdist("XLA on", "--jit_compile=true", settings=s),
                            _tfdist("XLA off", "--jit_compile=false", settings=s))],
        "mwms": lambda: [Row("mwms", "mwms", "MWMS 2 workers vs 1 worker, same global batch",
                             _tfdist("2 workers", settings=s, **two), _tfdist("1 worker", settings=s, strategy=mwms))],
        "allreduce": lambda: [
            Row("allreduce", "allreduce", "MWMS 2 workers: --all_reduce=ring vs auto",
                _tfdist("ring", "--all_reduce=ring", settings=s, **two),
                _tfdist("auto", "--all_reduce=auto", settings=s, **two)),
            Row("ar_bf16", "allreduce", "MWMS 2 workers: bfloat16 all-reduce vs float32",
                _tfdist("bfloat16", "--all_reduce_dtype=bfloat16", settings=s, **two),
                _tfdist("float32", "--all_reduce_dtype=float32", settings=s, **two)),
            Row("ar_pack", "allreduce", "MWMS 2 workers: gradients packed by 0.25 MB vs one pack (TF default)",
                _tfdist("0.25 MB packs", "--all_reduce_pack_mb=0.25", settings=s, **two),
                _tfdist("one pack", "--all_reduce_pack_mb=0", settings=s, **two))],
        "ps": lambda: [Row("ps", "ps", "1 ps + 2 workers vs 1 local worker, same global batch",
                           _tfdist("1 ps + 2 workers", settings=s, strategy="parameter_server",
                                   launcher=("launch_ps", "2", "1")),
                           _tfdist("1 worker", settings=s))],
        "ps_embedding": lambda: _ps_embedding_rows(s),
        "horovod": lambda: [Row("horovod", "horovod", "Horovod 2 ranks vs MWMS 2 workers (same TF)",
                                _tfdist("Horovod 2 ranks", settings=s, **horovod),
                                _tfdist("MWMS 2 workers", settings=s, **two, **hvd))],
        "hvd_fp16": lambda: [Row("hvd_fp16", "hvd_fp16", "Horovod 2 ranks: fp16 compression vs none",
                                 _tfdist("fp16", "--hvd_compression=fp16", settings=s, **horovod),
                                 _tfdist("none", "--hvd_compression=none", settings=s, **horovod))],
        "hvd_cycle": lambda: [Row("hvd_cycle", "hvd_cycle", "Horovod 2 ranks: HOROVOD_CYCLE_TIME 0.2 ms vs default",
                                  _tfdist("0.2 ms", settings=s, env=(("HOROVOD_CYCLE_TIME", "0.2"),), **horovod),
                                  _tfdist("default (1 ms)", settings=s, **horovod))],
        "spe": lambda: [Row(f"spe{n}", "spe", f"tfdist-train vs model.fit at steps_per_execution={n}",
                            _tfdist("tfdist-train", settings=s, spe=n), _keras("model.fit", settings=s, spe=n),
                            spe=n) for n in SPE_SWEEP],
        "peers": lambda: _peer_rows(s),
        "comm": lambda: _comm_rows(s),
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


# Selection ----------------------------------------------------------------------------
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
    no_horovod = ("no Python with horovod (horovodrun beside it) was given; pass "
                  "--horovod_python=.nox/tests-tf2-18-horovod/bin/python")
    for group in expand(requested):
        if group in HOROVOD_GROUPS and not settings.horovod_python:
            why[group] = no_horovod
        if group == "peers" and not settings.horovod_python:
            why["peer_horovod"] = no_horovod
        if group == "gpu" and gpus < 1:
            why[group] = "no GPU found (nvidia-smi -L lists none); --gpus=N forces N"
    return why

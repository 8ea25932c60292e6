"""scripts/benchmark.py: which rows a machine gets, and one real row end to end.

No TensorFlow runs on a GPU here, so the GPU rows are checked by selecting
them for stand-in GPU counts and reading the commands they would run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark", os.path.join(REPO, "scripts", "benchmark.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmark"] = module  # dataclasses resolve string annotations through sys.modules.
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("benchmark", None)


CPU_ROWS = ["fit", "input", "bf16", "jit", "mwms", "allreduce", "ar_bf16", "ar_pack", "ps",
            "sharded_vs_keras_sgd", "sharded_vs_keras_adagrad", "rows_1m_vs_10k",
            "spe1", "spe2", "spe5", "spe10", "spe20", "spe50", "peer_mwms", "peer_ps", "peer_mirrored",
            "comm_mwms", "comm_tf_keras", "comm_bf16", "comm_accum", "comm_ps", "comm_ps_unshaped"]


def test_cpu_only_machine_gets_cpu_rows_pinned_to_the_cpu(bench):
    rows = bench.select_rows(["all"], gpus=0)
    assert [r.name for r in rows] == CPU_ROWS
    assert all(r.device == "cpu" and r.a.visible_gpus == "" and r.b.visible_gpus == "" for r in rows)


def test_one_gpu_adds_single_gpu_rows_but_not_mirrored(bench):
    rows = bench.select_rows(["all"], gpus=1)
    assert [r.name for r in rows] == CPU_ROWS + ["gpu_fit", "gpu_bf16", "gpu_fp16", "gpu_xla"]
    gpu = {r.name: r for r in rows if r.device == "gpu"}
    assert all(r.a.visible_gpus == "0" and r.b.visible_gpus == "0" for r in gpu.values())
    assert gpu["gpu_fit"].b.program == "keras"
    assert "--precision=mixed_float16" in gpu["gpu_fp16"].a.flags and "--precision=float32" in gpu["gpu_fp16"].b.flags
    assert "--jit_compile=true" in gpu["gpu_xla"].a.flags and "--jit_compile=false" in gpu["gpu_xla"].b.flags


def test_four_gpus_add_mirrored_four_vs_one_at_the_same_global_batch(bench):
    rows = {r.name: r for r in bench.select_rows(["gpu"], gpus=4)}
    assert list(rows) == ["gpu_fit", "gpu_bf16", "gpu_fp16", "gpu_xla", "gpu_mirrored"]
    mirrored = rows["gpu_mirrored"]
    assert mirrored.a.visible_gpus == "0,1,2,3" and mirrored.b.visible_gpus == "0"
    assert {"--strategy=mirrored", "--num_gpus=4", "--global_batch_size=128"} <= set(mirrored.a.flags)
    assert {"--strategy=default", "--global_batch_size=128"} <= set(mirrored.b.flags)
    assert bench.select_rows(["gpu"], gpus=0) == []


def test_fit_and_spe_sides_match_everything_but_the_program(bench):
    rows = {r.name: r for r in bench.select_rows(["fit", "spe"], gpus=0)}
    fit = rows["fit"]
    assert "--steps_per_execution=10" in fit.a.flags and "--steps_per_execution=10" in fit.b.flags
    for n in bench.SPE_SWEEP:
        row = rows[f"spe{n}"]
        assert row.spe == n
        assert f"--steps_per_execution={n}" in row.a.flags and f"--steps_per_execution={n}" in row.b.flags
    for flag in ("--precision=float32", "--epochs=4", "--learning_rate=0.003", "--lr_schedule=cosine"):
        assert flag in fit.a.flags and flag in fit.b.flags
    assert "--global_batch_size=128" in fit.a.flags and "--batch_size=128" in fit.b.flags


def test_horovod_rows_need_a_horovod_python(bench):
    assert bench.select_rows(["horovod"], gpus=0) == []
    settings = bench.Settings(horovod_python="/opt/hvd/bin/python")
    (row,) = bench.select_rows(["horovod"], gpus=0, settings=settings)
    assert row.a.command("W")[:3] == ["/opt/hvd/bin/horovodrun", "-np", "2"]
    assert row.b.python == "/opt/hvd/bin/python" and "--strategy=multi_worker_mirrored" in row.b.flags


def test_unknown_row_lists_the_valid_ones(bench):
    with pytest.raises(ValueError, match="valid rows: all, fit, input"):
        bench.select_rows(["fit", "fast"], gpus=0)


def test_ratio_is_between_medians_and_sides_alternate(bench):
    order = []

    def fake(side):
        order.append(side.label)
        seconds = {"real digits": [9.0, 1.0, 2.0, 1.0], "synthetic": [9.0, 2.0, 2.0, 2.0]}[side.label]
        return {"epoch_train_seconds": seconds, "steps_per_epoch": 10, "global_batch_size": 100,
                "eval_accuracy": 0.5, "process_seconds": 1.0}

    (row,) = bench.select_rows(["input"], gpus=0)
    result = bench.measure(row, repeats=2, run=fake)
    assert order == ["real digits", "synthetic", "real digits", "synthetic"]
    assert result["a"]["median"] == pytest.approx(3000 / 4) and result["b"]["median"] == 500
    assert result["ratio_a_over_b"] == pytest.approx(1.5)
    assert result["target"] == 0.95 and result["target_met"] is True


def test_one_real_row_writes_json_and_chart(bench, tmp_path):
    pytest.importorskip("matplotlib")
    report = bench.main(["--rows=input", "--epochs=2", "--repeats=1", f"--out_dir={tmp_path}", "--gpus=0"])
    with open(tmp_path / "benchmark.json") as f:
        saved = json.load(f)
    assert saved["rows"][0]["row"] == "input" == report["rows"][0]["row"]
    assert {"machine", "settings", "rows", "duration_seconds", "spe_sweep", "skipped"} <= set(saved)
    assert {"cpu_model", "cpu_cores", "tensorflow", "keras", "date"} <= set(saved["machine"])
    row = saved["rows"][0]
    for side in ("a", "b"):
        assert {"examples_per_sec", "median", "min", "max", "eval_accuracy", "epoch_train_seconds"} <= set(row[side])
        assert row[side]["median"] > 0 and len(row[side]["epoch_train_seconds"][0]) == 2
    assert row["a"]["dataset"] == "mnist" and row["b"]["dataset"] == "synthetic"
    assert row["ratio_a_over_b"] == pytest.approx(row["a"]["median"] / row["b"]["median"], rel=1e-3)
    png = tmp_path / "benchmark.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_is_one_clear_paragraph(bench, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(SystemExit, match=r"pip install 'tfdist\[bench\]'.*--no_chart"):
        bench.main(["--rows=input", "--gpus=0"])


def test_communication_rows_change_one_setting_and_pass_horovod_env_only_to_their_side(bench):
    rows = {r.name: r for r in bench.select_rows(["allreduce", "hvd_cycle"], gpus=0,
                                                 settings=bench.Settings(horovod_python="/opt/hvd/bin/python"))}
    assert list(rows) == ["allreduce", "ar_bf16", "ar_pack", "hvd_cycle"]
    for name, flag in (("ar_bf16", "--all_reduce_dtype="), ("ar_pack", "--all_reduce_pack_mb=")):
        a, b = rows[name].a.flags, rows[name].b.flags
        assert [f for f in a if not f.startswith(flag)] == [f for f in b if not f.startswith(flag)]
        assert a != b
    cycle = rows["hvd_cycle"]
    assert cycle.a.flags == cycle.b.flags
    assert bench._env(cycle.a)["HOROVOD_CYCLE_TIME"] == "0.2"
    os.environ["HOROVOD_CYCLE_TIME"] = "9"  # Set by the caller: must not leak into the default side.
    try:
        assert "HOROVOD_CYCLE_TIME" not in bench._env(cycle.b)
    finally:
        del os.environ["HOROVOD_CYCLE_TIME"]


def test_peer_rows_match_the_peer_in_everything_but_the_program(bench):
    rows = {r.name: r for r in bench.select_rows(["peers"], gpus=0)}
    assert list(rows) == ["peer_mwms", "peer_ps", "peer_mirrored"]  # peer_horovod needs a Horovod Python.
    for name, launcher in (("peer_mwms", ("launch", "2")), ("peer_ps", ("launch_ps", "2", "1"))):
        row = rows[name]
        assert row.a.launcher == row.b.launcher == launcher and row.b.program == "peer_tf_keras"
        for flag in ("--epochs=4", "--precision=float32", "--steps_per_execution=10", "--learning_rate=0.003",
                     "--lr_schedule=constant"):
            assert flag in row.a.flags and flag in row.b.flags, (name, flag)
        assert "--global_batch_size=128" in row.a.flags and "--batch_size=128" in row.b.flags
        assert row.b.command("W")[-len(row.b.flags) - 1].endswith("scripts/peer_tf_keras.py")
    mirrored = rows["peer_mirrored"]
    assert "--num_cpu_replicas=2" in mirrored.a.flags and "--num_cpu_replicas=2" in mirrored.b.flags
    assert "--steps_per_execution=1" in mirrored.b.flags and "--steps_per_execution=10" in mirrored.a.flags
    assert "keras-team/keras#19246" in mirrored.title
    skipped = bench.skipped_groups(["peers"], 0, bench.Settings())
    assert "horovod" in skipped["peer_horovod"]
    settings = bench.Settings(horovod_python="/opt/hvd/bin/python")
    horovod = {r.name: r for r in bench.select_rows(["peers"], gpus=0, settings=settings)}["peer_horovod"]
    assert horovod.a.command("W")[0] == horovod.b.command("W")[0] == "/opt/hvd/bin/horovodrun"
    assert horovod.b.program == "peer_horovod" and horovod.b.python == "/opt/hvd/bin/python"


def test_comm_rows_shape_the_link_and_change_one_thing(bench):
    rows = {r.name: r for r in bench.select_rows(["comm"], gpus=0)}
    assert list(rows) == ["comm_mwms", "comm_tf_keras", "comm_bf16", "comm_accum", "comm_ps", "comm_ps_unshaped"]
    for name, row in rows.items():
        if name != "comm_ps_unshaped":
            assert row.a.link_rate == "1gbit" and "--link_rate=1gbit" in row.a.command("W")
    bound = rows["comm_mwms"]
    assert bound.score == "bound" and bound.b.launcher == ("parallel", "2") and bound.b.link_rate is None
    assert "--measure_bound" in bound.a.flags and "--measure_bound" not in bound.b.flags
    assert "--batch=512" in bound.b.flags and "--batch=1024" in bound.a.flags
    assert bound.b.command("W")[:2] == [sys.executable, os.path.join(REPO, "scripts", "comm_mlp.py")]
    for name, flag in (("comm_tf_keras", "--framework="), ("comm_bf16", "--all_reduce_dtype=")):
        a, b = rows[name].a.flags, rows[name].b.flags
        assert [f for f in a if not f.startswith(flag)] == [f for f in b if not f.startswith(flag)] and a != b
    accum = rows["comm_accum"]
    assert "--grad_accum_steps=4" in accum.a.flags and "--batch=4096" in accum.a.flags
    assert rows["comm_ps"].a.launcher == rows["comm_ps"].b.launcher == ("launch_ps", "2", "1")
    shaped, unshaped = rows["comm_ps"], rows["comm_ps_unshaped"]
    for side in ("a", "b"):
        assert getattr(unshaped, side).flags == getattr(shaped, side).flags
        assert getattr(unshaped, side).launcher == getattr(shaped, side).launcher
        command = getattr(unshaped, side).command("W")
        assert getattr(unshaped, side).link_rate is None and not any(c.startswith("--link_rate") for c in command)
        assert command[:3] == [sys.executable, "-m", "tfdist.cli.launch"]


def test_targets_of_the_comm_peer_and_embedding_rows(bench):
    targets = {r.name: r.target for r in bench.select_rows(["peers", "comm", "ps_embedding"], gpus=0)}
    assert targets["comm_mwms"] == pytest.approx(1 / 1.10)
    assert targets["comm_ps"] == targets["comm_ps_unshaped"] == 1.0
    assert targets["peer_mwms"] == targets["peer_ps"] == targets["peer_mirrored"] == 1.10
    assert targets["sharded_vs_keras_sgd"] == targets["sharded_vs_keras_adagrad"] == 20.0


def test_the_ideal_step_is_max_of_compute_and_ring_bytes_over_the_link(bench):
    from benchlib import stats

    # 10,539,048 gradient bytes a step, twice over one 1 Gbit/s link: 168.6 ms.
    ideal = stats.ideal_step(110.0, 10_539_048, "1gbit")
    assert ideal["comm_ms"] == pytest.approx(168.62, abs=0.01) and ideal["ideal_ms"] == ideal["comm_ms"]
    assert ideal["serial_ms"] == pytest.approx(278.62, abs=0.01)
    assert stats.ideal_step(200.0, 1_000_000, "100mbit")["comm_ms"] == pytest.approx(160.0)
    assert stats.ideal_step(200.0, 1_000_000, "100mbit")["ideal_ms"] == 200.0


def _comm_run(step_ms: float, bound: bool, forward: float = 60.0, backward: float = 110.0, comm: float = 170.0):
    seconds = step_ms * 8 / 1000  # 8 steps an epoch.
    run = {"epoch_train_seconds": [9.0, seconds, seconds], "steps_per_epoch": 8, "global_batch_size": 1024,
           "gradient_bytes": 10_539_048, "process_seconds": 1.0}
    if bound:
        run.update(t_forward_ms=forward, t_backward_ms=backward, t_comm_ms=comm, bound_ms=forward + max(backward, comm))
    return run


def test_a_bound_scored_row_is_met_within_1_10x_of_the_bound_its_a_side_measured(bench):
    (row, *_) = bench.select_rows(["comm"], gpus=0)
    steps = iter([250.0, 110.0, 240.0, 110.0, 260.0, 110.0])  # A, B, A, B, A, B: A's median 250 ms.
    result = bench.measure(row, repeats=3, run=lambda side: _comm_run(next(steps), side.launcher == ("launch", "2")))
    extra = result["extra"]
    assert extra["bound_ms"] == 230.0 and extra["bound_ms_per_run"] == [230.0] * 3
    assert (extra["t_forward_ms"], extra["t_backward_ms"], extra["t_comm_ms"]) == (60.0, 110.0, 170.0)
    assert result["scored"] == pytest.approx(230 / 250, abs=1e-3) and result["target_met"] is True
    assert extra["ideal_ms"] == pytest.approx(168.62, abs=0.01) and extra["compute_ms"] == 110.0  # Informative.
    slow = bench.measure(row, repeats=1, run=lambda side: _comm_run(260.0 if side.launcher == ("launch", "2")
                                                                    else 110.0, side.launcher == ("launch", "2")))
    assert slow["scored"] == pytest.approx(230 / 260, abs=1e-3) and slow["target_met"] is False  # 1.13x the bound.


def test_a_bound_scored_row_whose_runs_reported_no_bound_fails(bench):
    (row, *_) = bench.select_rows(["comm"], gpus=0)
    with pytest.raises(RuntimeError, match="measure_bound"):
        bench.measure(row, repeats=1, run=lambda side: _comm_run(250.0, bound=False))


def test_printed_figures_are_found_behind_a_launcher_prefix(bench):
    from benchlib import runner

    out = 'noise\n[worker:0] BENCH {"steps_per_epoch": 3}\n[worker:1] done\n'
    assert runner.printed_metrics(out) == {"steps_per_epoch": 3}
    assert runner.printed_metrics('{"a": 1}\n') == {"a": 1}
    assert runner.printed_metrics("nothing\n") is None


def test_the_scaling_model_reproduces_its_calibration_step_and_predicts_the_others(bench):
    from benchlib import stats

    def row(name, step, extra=None, batches=(1024, 1024)):
        return {"row": name, "a_step_ms": step, "extra": extra or {},
                "a": {"global_batch_size": batches[0]}, "b": {"global_batch_size": batches[1]}}

    ideal = stats.ideal_step(100.0, 10_000_000, "1gbit")  # comm 160 ms nominal.
    rows = [row("comm_mwms", 300.0, {**ideal, "gradient_bytes": 10_000_000, "link_rate": "1gbit"}),
            row("comm_bf16", 200.0), row("comm_accum", 600.0, batches=(4096, 1024))]
    model = stats.scaling_model(rows)
    assert model["link_efficiency"] == pytest.approx(160 / 200)
    assert model["checks"]["comm_mwms_step_ms"] == {"predicted": 300.0, "measured": 300.0}
    assert model["checks"]["comm_bf16_step_ms"]["predicted"] == 200.0  # 100 + 200 / 2.
    assert model["checks"]["comm_accum_step_ms"]["predicted"] == 600.0  # 4 x 100 + 200.
    # 10 Gbit/s, 2 workers, own links: 1 x 10 MB x 8 / (10 Gbit/s x 0.8) = 10 ms; 100 / 110.
    assert model["efficiency"]["10gbit"]["serial_fp32"]["2"] == pytest.approx(100 / 110, abs=1e-3)
    assert "| 10gbit | serial, fp32 | 0.91 |" in stats.scaling_table(model)


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("overlap_probe", os.path.join(REPO, "scripts", "overlap_probe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overlap_probe_buckets_layers_last_first_and_bounds_by_forward_plus_the_longer_part(probe):
    layers = [2_101_248, 4_198_400, 4_198_400, 41_000]  # comm_mlp's MLP: bytes of each layer's kernel and bias.
    assert probe.layer_buckets(layers, 0) == [[3], [2], [1], [0]]
    assert probe.layer_buckets(layers, 4) == [[3, 2], [1], [0]]
    assert probe.layer_buckets(layers, 100) == [[3, 2, 1, 0]]
    assert probe.bound({"forward": 60.0, "compute": 170.0, "comm": 150.0})["bound_ms"] == 210.0
    assert probe.bound({"forward": 60.0, "compute": 170.0, "comm": 200.0}) == {
        "t_forward_ms": 60.0, "t_backward_ms": 110.0, "t_comm_ms": 200.0, "bound_ms": 260.0}


def test_overlap_probe_reads_each_traced_step_against_its_last_matmul(probe):
    ms = 1_000_000
    events = [(0, 300 * ms, "step"), (1 * ms, 20 * ms, "matmul"), (50 * ms, 100 * ms, "collective"),
              (60 * ms, 120 * ms, "matmul"), (120 * ms, 200 * ms, "collective"), (400 * ms, 500 * ms, "step"),
              (410 * ms, 420 * ms, "matmul"), (430 * ms, 490 * ms, "collective")]
    first, second = probe.trace_steps(events)
    assert first == {"step_ms": 300.0, "last_matmul_end_ms": 120.0, "collectives_ms": [[50.0, 100.0], [120.0, 200.0]],
                     "started_before_last_matmul_end": 1, "collective_ms_before_it": 50.0,
                     "collective_ms_after_it": 80.0}
    assert second["started_before_last_matmul_end"] == 0 and second["collective_ms_after_it"] == 60.0


def test_overlap_probe_runs_every_mode_on_one_worker():
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "overlap_probe.py"), "--features=8",
                          "--width=16", "--batch=32", "--steps=2", "--warmup=1"], capture_output=True, text=True,
                         env={**env, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=300, check=True).stdout
    (line,) = [x for x in out.splitlines() if x.startswith("OVERLAP ")]
    result = json.loads(line[len("OVERLAP "):])
    assert set(result["modes"]) == {"forward", "compute", "comm", "serial", "overlap", "overlap_flow", "overlap_pack"}
    assert result["buckets"] == [[3], [2], [1], [0]] and result["workers"] == 1
    assert {"bound_ms", "overlap_over_serial", "threads"} <= set(result)


def test_sides_tfdist_launch_does_not_start_get_its_thread_split(bench, monkeypatch):
    # tfdist-launch splits the cores between its tasks; N copies ("parallel") and horovodrun ranks get the same
    # split from the runner, so both sides of a row size their thread pools alike. A variable the caller set wins.
    for name in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    rows = {r.name: r for r in bench.select_rows(["comm", "horovod"], gpus=0,
                                                 settings=bench.Settings(horovod_python="/opt/hvd/bin/python"))}
    copies, ranks, launched = rows["comm_mwms"].b, rows["horovod"].a, rows["comm_mwms"].a
    assert copies.launcher == ("parallel", "2") and ranks.launcher[0] == "horovodrun"
    for side in (copies, ranks):
        env = bench._env(side)
        assert (env["OMP_NUM_THREADS"], env["TF_NUM_INTRAOP_THREADS"], env["TF_NUM_INTEROP_THREADS"]) == ("4", "4", "4")
    assert "OMP_NUM_THREADS" not in bench._env(launched)  # tfdist-launch sets it for its own tasks.
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert bench._env(copies)["OMP_NUM_THREADS"] == "3"

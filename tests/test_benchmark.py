"""scripts/benchmark.py: which rows a machine gets, and one real row end to end.

No TensorFlow runs on a GPU here, so the GPU rows are checked by selecting
them for stand-in GPU counts and reading the commands they would run.
"""

from __future__ import annotations

import importlib.util
import json
import os
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
            "comm_mwms", "comm_tf_keras", "comm_bf16", "comm_accum", "comm_ps"]


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
    assert list(rows) == ["comm_mwms", "comm_tf_keras", "comm_bf16", "comm_accum", "comm_ps"]
    for row in rows.values():
        assert row.a.link_rate == "1gbit" and "--link_rate=1gbit" in row.a.command("W")
    ideal = rows["comm_mwms"]
    assert ideal.score == "ideal" and ideal.b.launcher == ("parallel", "2") and ideal.b.link_rate is None
    assert "--batch=512" in ideal.b.flags and "--batch=1024" in ideal.a.flags
    assert ideal.b.command("W")[:2] == [sys.executable, os.path.join(REPO, "scripts", "comm_mlp.py")]
    for name, flag in (("comm_tf_keras", "--framework="), ("comm_bf16", "--all_reduce_dtype=")):
        a, b = rows[name].a.flags, rows[name].b.flags
        assert [f for f in a if not f.startswith(flag)] == [f for f in b if not f.startswith(flag)] and a != b
    accum = rows["comm_accum"]
    assert "--grad_accum_steps=4" in accum.a.flags and "--batch=4096" in accum.a.flags
    assert rows["comm_ps"].a.launcher == rows["comm_ps"].b.launcher == ("launch_ps", "2", "1")


def test_the_ideal_step_is_max_of_compute_and_ring_bytes_over_the_link(bench):
    from benchlib import stats

    # 10,539,048 gradient bytes a step, twice over one 1 Gbit/s link: 168.6 ms.
    ideal = stats.ideal_step(110.0, 10_539_048, "1gbit")
    assert ideal["comm_ms"] == pytest.approx(168.62, abs=0.01) and ideal["ideal_ms"] == ideal["comm_ms"]
    assert ideal["serial_ms"] == pytest.approx(278.62, abs=0.01)
    assert stats.ideal_step(200.0, 1_000_000, "100mbit")["comm_ms"] == pytest.approx(160.0)
    assert stats.ideal_step(200.0, 1_000_000, "100mbit")["ideal_ms"] == 200.0


def test_an_ideal_scored_row_is_met_by_the_ideal_over_the_measured_step(bench):
    def fake(side):
        seconds = 1.6 if side.launcher == ("launch", "2") else 0.88  # 200 ms vs 110 ms a step, 8 steps an epoch.
        return {"epoch_train_seconds": [9.0, seconds, seconds], "steps_per_epoch": 8, "global_batch_size": 1024,
                "gradient_bytes": 10_539_048, "process_seconds": 1.0}

    (row, *_) = bench.select_rows(["comm"], gpus=0)
    result = bench.measure(row, repeats=1, run=fake)
    assert result["extra"]["ideal_ms"] == pytest.approx(168.62, abs=0.01)
    assert result["scored"] == pytest.approx(168.62 / 200, abs=1e-3) and result["target_met"] is False


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

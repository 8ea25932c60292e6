"""Keras' own fit/evaluate/predict tests, run through tfdist on 2 CPU replicas (the conformance run).

Two subprocesses run Keras test files from the installed keras package (tests/keras_conformance/files.py: FILES,
the trainer, callback and tf.data adapter tests, and the broad set: models, layers, optimizers, metrics, saving,
distillation, the TensorFlow backend), with the plugin tests/keras_conformance/plugin.py: baseline (Keras as it
is) and tfdist (every `fit`, `evaluate`, `predict`, `test_on_batch` and `predict_on_batch` call, and
`train_on_batch` where tfdist has it, routed to tfdist's function of that name under a 2-replica
MirroredStrategy). Each writes a JSON file of outcomes per Keras test id. This test then holds that, of the
judged tests (every test of FILES; of a broad file, those that call one of those methods in baseline),

  - every Keras test that passes in baseline passes through tfdist, or is listed, with its reason, in
    tests/keras_conformance/known_failures.txt (`<test id>  # <category>: <reason>`);
  - every listed test still fails through tfdist (one that passes now must leave the list) and still passes in
    baseline (a renamed or removed Keras test must leave it too);
  - the routing really happened: Keras' own methods never ran in the tfdist mode, every baseline test that
    called them called tfdist instead, and the strategy's scope was in force at every call;
  - every file ran tests in both modes, and some test of it called one of those methods;

and reports "N of M of Keras' own fit tests pass through tfdist on 2 replicas" (M: the judged baseline passes
that call those methods). CI (KERAS_CONFORMANCE_SET unset: "sample") runs FILES whole and, of each broad file,
the one test tests/keras_conformance/sample.txt names (its quickest calling test); `nox -s keras-conformance`
(KERAS_CONFORMANCE_SET=all) runs every test and then also checks that the
README states the count. A listed test whose file did not run is not judged.

By hand (the same commands; `strategy` instead of `tfdist` runs Keras' own methods under the same strategy, to
tell a harness failure from a tfdist one):
  python -m pytest -p tests.keras_conformance.plugin -p no:cacheprovider -p no:xdist -q --keras-conformance=tfdist \\
      --keras-conformance-results=/tmp/tfdist.json $(python -m tests.keras_conformance.plugin files)
  python -m tests.keras_conformance.plugin draft /tmp/baseline.json /tmp/tfdist.json   # known-failure lines
  python -m tests.keras_conformance.plugin mechanisms /tmp/baseline.json /tmp/tfdist.json  # by tfdist frame
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, subprocess_env
from tests.keras_conformance import collection, files, limits, plugin, results

KNOWN_FAILURES = os.path.join(REPO, "tests", "keras_conformance", "known_failures.txt")
# Which tests run (KERAS_CONFORMANCE_SET): "sample" (CI's default): FILES whole and, of each broad file, the one test
# sample.txt names; "all" (the nox session keras-conformance): every test, and only that run checks the README's
# count; "files": FILES alone.
SET_ENV = "KERAS_CONFORMANCE_SET"
SETS = ("sample", "all", "files")
SAMPLE = os.path.join(REPO, "tests", "keras_conformance", "sample.txt")
RUN_TIMEOUT_S = {"sample": 1800, "files": 900, "all": 7200}  # Each mode (the sample: 936 s beside CI).


def _set() -> str:
    value = os.environ.get(SET_ENV, "sample").strip().lower()
    if value not in SETS:
        raise pytest.UsageError(f"{SET_ENV}={value!r}: expected one of {', '.join(SETS)}")
    return value


def _test_files(chosen: str) -> list[str]:
    return files.keras_test_files(broad=chosen != "files")


def _command(mode: str, results_path: str, chosen: str) -> list[str]:
    keras_dir = files.keras_dir()
    return [sys.executable, "-m", "pytest", "-p", "tests.keras_conformance.plugin", "-p", "no:cacheprovider",
            "-p", "no:warnings", "-p", "no:xdist", "-q", "--tb=short", "--confcutdir", keras_dir,
            f"--keras-conformance={mode}", f"--keras-conformance-results={results_path}",
            *([f"--keras-conformance-sample={SAMPLE}"] if chosen == "sample" else []), *_test_files(chosen)]


def _start(mode: str, tmp_path, chosen: str) -> tuple[subprocess.Popen, str, str, float, float]:
    results_path, log = str(tmp_path / f"{mode}.json"), str(tmp_path / f"{mode}.log")
    env = subprocess_env({"KERAS_BACKEND": "tensorflow"})
    env.pop("PYTEST_ADDOPTS", None)
    with open(log, "w") as out:
        process = subprocess.Popen(_command(mode, results_path, chosen), stdout=out, stderr=subprocess.STDOUT,
                                   env=env, cwd=REPO)
    return process, results_path, log, time.time(), RUN_TIMEOUT_S[chosen]


def _finish(mode: str, process: subprocess.Popen, results_path: str, log: str, started: float,
            timeout: float) -> tuple[dict, float]:
    try:
        code = process.wait(timeout=max(1.0, timeout - (time.time() - started)))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        code = None
    wall = time.time() - started
    with open(log) as f:
        tail = f.read()[-6000:]
    data = None
    if os.path.exists(results_path):
        with open(results_path) as f:
            data = json.load(f)
    if code is None:
        pytest.fail(f"The {mode} run of Keras' tests took more than {timeout:.0f} s.\n{tail}")
    if code == limits.EXIT_KILLED and data is not None:
        pytest.fail(f"The {mode} run of Keras' tests was stopped: {data.get('killed')} (a test that neither ended "
                    f"nor gave way to the plugin's limit; its results so far are in {results_path}).\n{tail}")
    if code not in (0, 1) or data is None:  # 1: some tests failed, which the comparison judges.
        pytest.fail(f"The {mode} run of Keras' tests ended with status {code} and "
                    f"{'no' if data is None else 'a'} results file.\n{tail}")
    return data, wall


def _describe(record: dict) -> str:
    where = " ".join(record.get(k) or "" for k in ("tfdist_frame", "test_frame")).strip() or record.get("raised_at")
    return f"{record.get('outcome')}: {record.get('error', '')[:240]}" + (f" [{where}]" if where else "")


README = os.path.join(REPO, "README.md")


def _what_differs() -> str:
    with open(README) as f:
        text = f.read()
    return " ".join(text[text.index("## What differs from `Model.fit`"):].split("\n## ", 1)[0].split())


def _count(result: dict) -> str:
    return (f"{result['fit_tests_passing']} of {result['fit_tests']} of Keras' own fit tests pass through tfdist "
            f"on {plugin.NUM_REPLICAS} replicas")


def test_every_known_failure_category_is_named_in_the_readme():
    """The list is the README's "What differs" table: each category a user can look up there, in bold."""
    known, _ = results.read_known_failures(KNOWN_FAILURES)
    section = _what_differs()
    missing = sorted({category for category, _ in known.values() if f"**{category}**" not in section})
    assert not missing, f"README's 'What differs' section does not name these known-failure categories: {missing}"


def _routing_problems(result: dict, through: dict) -> list[str]:
    """The routing really happened: tfdist was called, Keras' own methods were not, under the strategy's scope."""
    problems = []
    routed = sum(sum(r["routed"].values()) for r in through["tests"].values())
    if result["fit_tests"] == 0 or routed == 0:
        problems.append(f"Nothing was measured: {result['fit_tests']} baseline tests call fit/evaluate/predict and "
                        f"{routed} calls went to tfdist.")
    if result["keras_calls"]:
        problems.append("Keras' own fit/evaluate/predict ran in the tfdist mode (the routing was bypassed) in: "
                        + ", ".join(result["keras_calls"]))
    if result["not_routed"]:
        problems.append("These tests call fit/evaluate/predict in baseline but passed in the tfdist mode without a "
                        "call to tfdist: " + ", ".join(result["not_routed"]))
    if result["scope_trouble"]:
        problems.append("The strategy's scope was not in force at a routed call, or was lost, in: "
                        + ", ".join(result["scope_trouble"]))
    return problems


def _list_problems(result: dict, baseline: dict, through: dict, known: dict) -> list[str]:
    """known_failures.txt is exact: every unlisted failure is a problem, and so is every listed pass."""
    problems, listed = [], os.path.relpath(KNOWN_FAILURES, REPO)
    if result["unexpected"]:
        problems.append(
            f"{len(result['unexpected'])} Keras test(s) pass in baseline but not through tfdist, and are not in "
            f"{listed}; fix tfdist, or list each with its reason (`<test id>  # <category>: <reason>`):\n" + "\n".join(
                f"  {t}  -- {_describe(through['tests'].get(t, {'outcome': 'not run'}))}"
                for t in result["unexpected"]))
    if result["now_passing"]:
        problems.append(
            f"{len(result['now_passing'])} test(s) listed in {listed} pass through tfdist now; remove their lines so "
            "the list stays true:\n" + "\n".join(f"  {t}  # {known[t][0]}" for t in result["now_passing"]))
    if result["not_baseline"]:
        problems.append(
            f"{len(result['not_baseline'])} listed test(s) no longer pass in baseline (renamed, removed or broken in "
            "this Keras); remove or update their lines:\n" + "\n".join(
                f"  {t}  -- baseline {baseline['tests'].get(t, {}).get('outcome', 'not collected')}"
                for t in result["not_baseline"]))
    return problems


def _coverage_problems(baseline: dict, through: dict, chosen: str) -> list[str]:
    """Every file the run uses ran tests in both modes (a file that fails to import runs none), and fits."""
    keras_root = os.path.dirname(files.keras_dir())
    wanted = {os.path.relpath(path, keras_root).replace(os.sep, "/") for path in _test_files(chosen)}
    problems = []
    for name, data in (("baseline", baseline), ("tfdist", through)):
        seen = {t.split("::", 1)[0] for t in results.ran(data)}
        if wanted - seen:
            problems.append(f"These test files ran no test in the {name} mode (an import or collection error?): "
                            + ", ".join(sorted(wanted - seen)))
    fitting = {t.split("::", 1)[0] for t, r in baseline["tests"].items() if results.calls_fit(r)}
    if wanted - fitting:
        problems.append("No test of these files called fit/evaluate/predict in baseline (leave them out, in "
                        "files.LEFT_OUT, with the reason): " + ", ".join(sorted(wanted - fitting)))
    return problems


def test_keras_conformance(tmp_path, record_property):
    missing = [path for path in files.keras_test_files() if not os.path.exists(path)]
    assert not missing, f"This Keras ({files.keras_dir()}) lacks test files the conformance run uses: {missing}"
    known, known_version = results.read_known_failures(KNOWN_FAILURES)
    chosen = _set()

    started = {mode: _start(mode, tmp_path, chosen) for mode in ("baseline", "tfdist")}  # Side by side.
    finished = {mode: _finish(mode, *started[mode]) for mode in started}
    (baseline, baseline_wall), (through, tfdist_wall) = finished["baseline"], finished["tfdist"]
    result = results.compare(baseline, through, known)

    failing_categories = collections.Counter(known[t][0] for t in known if t in results.ran(through))
    scope = {"all": "every test", "files": "the trainer, callback and adapter files only",
             "sample": "those files whole and one test of each broad file"}[chosen]
    summary = (f"{_count(result)} ({result['baseline_passing_through_tfdist']} of {result['baseline_passing']} "
               f"baseline passes in all; {scope}; Keras {through['keras_version']}, TensorFlow "
               f"{through['tensorflow_version']}); wall time: baseline {baseline_wall:.0f} s, tfdist {tfdist_wall:.0f} "
               "s, side by side")
    print(summary)
    for category, count in failing_categories.most_common():
        print(f"  known failures, {category}: {count}")
    record_property("keras_conformance", summary)

    problems = (_routing_problems(result, through) + _list_problems(result, baseline, through, known)
                + _coverage_problems(baseline, through, chosen))
    if chosen == "all" and _count(result) not in _what_differs():
        problems.append(f"The README's 'What differs' section must state the measured count: \"{_count(result)}\".")
    if problems:
        note = ""
        if known_version and known_version != through["keras_version"]:
            note = (f"(known_failures.txt was made with Keras {known_version}; this is Keras "
                    f"{through['keras_version']}: Keras' test ids and behaviour change between releases.)\n")
        pytest.fail(summary + "\n" + note + "\n\n".join(problems), pytrace=False)


def _record(outcome: str, keras: int = 0, routed: int = 0) -> dict:
    return {"outcome": outcome, "keras": {"fit": keras} if keras else {}, "routed": {"fit": routed} if routed else {},
            "unrouted": {}, "scope_missing": 0, "scope_lost": 0}


def test_compare_judges_every_trainer_test_and_the_fit_tests_of_broad_files():
    """A broad file's test that never fits is not judged; a test the sample left out is not counted either way."""
    trainer, broad = "keras/src/trainers/trainer_test.py::T::", "keras/src/layers/core/dense_test.py::T::"
    baseline = {"tests": {trainer + "no_fit": _record("passed"), trainer + "fit": _record("passed", keras=1),
                          broad + "no_fit": _record("passed"), broad + "fit": _record("passed", keras=1),
                          broad + "fit_fails": _record("passed", keras=1)}}
    through = {"tests": {trainer + "no_fit": _record("failed"), trainer + "fit": _record("passed", routed=1),
                         broad + "no_fit": _record("failed"), broad + "fit": _record("passed", routed=1),
                         broad + "fit_fails": _record("failed", routed=1)}}
    result = results.compare(baseline, through, {broad + "not_sampled": ("harness", "listed")})
    assert result["unexpected"] == [broad + "fit_fails", trainer + "no_fit"]
    assert (result["fit_tests"], result["fit_tests_passing"]) == (3, 2)
    assert (result["routed_tests"], result["routed_tests_passing"]) == (3, 2)
    assert result["not_baseline"] == [] and result["now_passing"] == []


def test_the_sample_is_one_calling_test_of_each_broad_file():
    """CI's sample names one test of every broad file (a stale id runs nothing: the run's coverage check says so)."""
    sampled = sorted(collection.read_ids(SAMPLE))
    by_file = collections.Counter(test.split("::", 1)[0] for test in sampled)
    assert sorted(by_file) == sorted("keras/" + f for f in files.broad_files())
    assert set(by_file.values()) == {1}


def test_sample_picks_each_broad_files_quickest_passing_calling_test():
    dense, conv = "keras/src/layers/core/dense_test.py::T::", "keras/src/layers/convolutional/conv_test.py::T::"
    baseline = {"tests": {dense + "slow": _record("passed", keras=1), dense + "quick": _record("passed", keras=1),
                          dense + "no_fit": _record("passed"), dense + "fails": _record("passed", keras=1),
                          conv + "fails": _record("passed", keras=1)}}
    through = {"tests": {dense + "slow": {**_record("passed", routed=1), "duration": 9.0},
                         dense + "quick": {**_record("passed", routed=1), "duration": 2.0},
                         dense + "no_fit": {**_record("passed"), "duration": 0.1},
                         dense + "fails": {**_record("failed", routed=1), "duration": 0.5},
                         conv + "fails": {**_record("failed", routed=1), "duration": 3.0}}}
    assert results.sample(baseline, through) == [f"{conv}fails  # tfdist 3.0 s, fails",
                                                 f"{dense}quick  # tfdist 2.0 s"]


def test_the_broad_files_are_the_named_directories_tests_that_fit():
    chosen = files.broad_files()
    assert not set(chosen) & set(files.FILES)
    assert not [f for f in chosen if any(f == p or f.startswith(p + "/") for p in files.LEFT_OUT)]
    for directory in ("src/models", "src/layers", "src/optimizers", "src/metrics", "src/saving",
                      "src/distillation", "src/backend/tensorflow"):
        assert any(f.startswith(directory + "/") for f in chosen), directory
    for relative in chosen:
        with open(os.path.join(files.keras_dir(), relative), encoding="utf-8") as f:
            assert files.CALLS.search(f.read()), relative

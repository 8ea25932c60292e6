"""Keras' own fit/evaluate/predict tests, run through tfdist on 2 CPU replicas (the conformance run).

Two subprocesses run the Keras test files named in tests/keras_conformance/plugin.py (FILES) from the installed
keras package, with the plugin tests/keras_conformance/plugin.py: baseline (Keras as it is) and tfdist (every
`fit`, `evaluate` and `predict` call routed to `tfdist.fit`, `tfdist.evaluate`, `tfdist.predict` under a
2-replica MirroredStrategy). Each writes a JSON file of outcomes per Keras test id. This test then holds that

  - every Keras test that passes in baseline passes through tfdist, or is listed, with its reason, in
    tests/keras_conformance/known_failures.txt (`<test id>  # <category>: <reason>`);
  - every listed test still fails through tfdist (one that passes now must leave the list) and still passes in
    baseline (a renamed or removed Keras test must leave it too);
  - the routing really happened: Keras' own fit/evaluate/predict never ran in the tfdist mode, every baseline test
    that called them called tfdist instead, and the strategy's scope was in force at every call;

and reports "N of M of Keras' own fit tests pass through tfdist on 2 replicas" (M: the baseline passes that call
fit, evaluate or predict). The two runs go side by side (about 1.5 and 3 minutes of one core each).

By hand (the same commands):
  python -m pytest -p tests.keras_conformance.plugin -p no:cacheprovider -q --keras-conformance=tfdist \\
      --keras-conformance-results=/tmp/tfdist.json $(python -m tests.keras_conformance.plugin files)
  python -m tests.keras_conformance.plugin draft /tmp/baseline.json /tmp/tfdist.json   # known-failure lines
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
from tests.keras_conformance import plugin

KNOWN_FAILURES = os.path.join(REPO, "tests", "keras_conformance", "known_failures.txt")
RUN_TIMEOUT_S = 900  # Each mode; about 220 s alone, 490 s beside a CI run on 2 cores.


def _command(mode: str, results: str) -> list[str]:
    keras_dir = plugin.keras_dir()
    return [sys.executable, "-m", "pytest", "-p", "tests.keras_conformance.plugin", "-p", "no:cacheprovider",
            "-p", "no:warnings", "-q", "--tb=short", "--confcutdir", keras_dir,
            f"--keras-conformance={mode}", f"--keras-conformance-results={results}", *plugin.keras_test_files()]


def _start(mode: str, tmp_path) -> tuple[subprocess.Popen, str, str, float]:
    results, log = str(tmp_path / f"{mode}.json"), str(tmp_path / f"{mode}.log")
    env = subprocess_env({"KERAS_BACKEND": "tensorflow"})
    env.pop("PYTEST_ADDOPTS", None)
    with open(log, "w") as out:
        process = subprocess.Popen(_command(mode, results), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return process, results, log, time.time()


def _finish(mode: str, process: subprocess.Popen, results: str, log: str, started: float) -> tuple[dict, float]:
    try:
        code = process.wait(timeout=max(1.0, RUN_TIMEOUT_S - (time.time() - started)))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        code = None
    wall = time.time() - started
    with open(log) as f:
        tail = f.read()[-6000:]
    data = None
    if os.path.exists(results):
        with open(results) as f:
            data = json.load(f)
    if code is None:
        pytest.fail(f"The {mode} run of Keras' tests took more than {RUN_TIMEOUT_S} s.\n{tail}")
    if code == plugin.EXIT_KILLED and data is not None:
        pytest.fail(f"The {mode} run of Keras' tests was stopped: {data.get('killed')} (a test that neither ended "
                    f"nor gave way to the plugin's limit; its results so far are in {results}).\n{tail}")
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


def test_every_known_failure_category_is_named_in_the_readme():
    """The list is the README's "What differs" table: each category a user can look up there, in bold."""
    known, _ = plugin.read_known_failures(KNOWN_FAILURES)
    section = _what_differs()
    missing = sorted({category for category, _ in known.values() if f"**{category}**" not in section})
    assert not missing, f"README's 'What differs' section does not name these known-failure categories: {missing}"


def test_keras_conformance(tmp_path, record_property):
    missing = [path for path in plugin.keras_test_files() if not os.path.exists(path)]
    assert not missing, f"This Keras ({plugin.keras_dir()}) lacks test files the conformance run uses: {missing}"
    known, known_version = plugin.read_known_failures(KNOWN_FAILURES)

    started = {mode: _start(mode, tmp_path) for mode in plugin.MODES}  # Side by side.
    finished = {mode: _finish(mode, *started[mode]) for mode in plugin.MODES}
    (baseline, baseline_wall), (through, tfdist_wall) = finished["baseline"], finished["tfdist"]
    result = plugin.compare(baseline, through, known)

    failing_categories = collections.Counter(known[t][0] for t in known if t in baseline["tests"])
    summary = (f"{result['fit_tests_passing']} of {result['fit_tests']} of Keras' own fit tests pass through tfdist "
               f"on {plugin.NUM_REPLICAS} replicas ({result['baseline_passing_through_tfdist']} of "
               f"{result['baseline_passing']} baseline passes in all; Keras {through['keras_version']}, "
               f"TensorFlow {through['tensorflow_version']}); wall time: baseline {baseline_wall:.0f} s, "
               f"tfdist {tfdist_wall:.0f} s, side by side")
    print(summary)
    for category, count in failing_categories.most_common():
        print(f"  known failures, {category}: {count}")
    record_property("keras_conformance", summary)

    routed = sum(sum(r["routed"].values()) for r in through["tests"].values())
    problems = []
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
    if result["unexpected"]:
        problems.append(
            f"{len(result['unexpected'])} Keras test(s) pass in baseline but not through tfdist, and are not in "
            f"{os.path.relpath(KNOWN_FAILURES, REPO)}; fix tfdist, or list each with its reason "
            "(`<test id>  # <category>: <reason>`):\n" + "\n".join(
                f"  {t}  -- {_describe(through['tests'].get(t, {'outcome': 'not run'}))}"
                for t in result["unexpected"]))
    if result["now_passing"]:
        problems.append(
            f"{len(result['now_passing'])} test(s) listed in {os.path.relpath(KNOWN_FAILURES, REPO)} pass through "
            "tfdist now; remove their lines so the list stays true:\n" + "\n".join(
                f"  {t}  # {known[t][0]}" for t in result["now_passing"]))
    if result["not_baseline"]:
        problems.append(
            f"{len(result['not_baseline'])} listed test(s) no longer pass in baseline (renamed, removed or broken in "
            "this Keras); remove or update their lines:\n" + "\n".join(
                f"  {t}  -- baseline {baseline['tests'].get(t, {}).get('outcome', 'not collected')}"
                for t in result["not_baseline"]))
    count = (f"{result['fit_tests_passing']} of {result['fit_tests']} of Keras' own fit tests pass through tfdist "
             f"on {plugin.NUM_REPLICAS} replicas")
    if count not in _what_differs():
        problems.append(f"The README's 'What differs' section must state the measured count: \"{count}\".")
    if problems:
        note = ""
        if known_version and known_version != through["keras_version"]:
            note = (f"(known_failures.txt was made with Keras {known_version}; this is Keras "
                    f"{through['keras_version']}: Keras' test ids and behaviour change between releases.)\n")
        pytest.fail(summary + "\n" + note + "\n\n".join(problems), pytrace=False)

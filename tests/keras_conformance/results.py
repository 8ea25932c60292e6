"""Reading the conformance run's results and its known-failures list, and comparing the two modes.

  python -m tests.keras_conformance.results draft BASELINE.json TFDIST.json   # known-failure lines to fill in
  python -m tests.keras_conformance.results mechanisms TFDIST.json            # failures grouped by tfdist frame
  python -m tests.keras_conformance.results sample BASELINE.json TFDIST.json  # CI's sample.txt, from a full run
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
from typing import Any, Optional

from tests.keras_conformance.files import FILES, keras_dir

KNOWN_LINE = re.compile(r"^(?P<id>\S+)\s+#\s*(?P<category>[^:]+?)\s*:\s*(?P<reason>\S.*)$")


def read_known_failures(path: str) -> tuple[dict[str, tuple[str, str]], Optional[str]]:
    """({test id: (category, reason)}, the Keras version the list was made with, from '# keras X.Y.Z')."""
    known: dict[str, tuple[str, str]] = {}
    version = None
    with open(path) as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                found = re.match(r"#\s*keras\s+(\S+)", line)
                if found and version is None:
                    version = found.group(1).rstrip(",")
                continue
            match = KNOWN_LINE.match(line)
            if not match:
                raise ValueError(f"{path}:{number}: expected '<test id>  # <category>: <reason>', got {line!r}")
            if match["id"] in known:
                raise ValueError(f"{path}:{number}: {match['id']} is listed twice")
            known[match["id"]] = (match["category"], match["reason"])
    return known, version


def passed(results: dict) -> set[str]:
    return {t for t, r in results["tests"].items() if r["outcome"] == "passed"}


def ran(results: dict) -> set[str]:
    """The tests the run ran (a test CI's sample or --keras-conformance-only left out is not in the results)."""
    return set(results["tests"])


def calls_fit(record: dict) -> bool:
    return sum(record["keras"].values()) > 0


def judged(test: str, baseline: dict) -> bool:
    """Every test of FILES; of a broad file, the tests that call fit/evaluate/predict/... in baseline.

    A broad file's other tests (a saving or optimizer test that never fits) never reach tfdist; some of them fail
    only because the run's strategy scope is in force, which says nothing about tfdist.
    """
    return test.split("::", 1)[0].split("/", 1)[-1] in FILES or calls_fit(baseline["tests"].get(test, _NO_CALLS))


_NO_CALLS: dict = {"keras": {}}


def compare(baseline: dict, through: dict, known: dict[str, tuple[str, str]]) -> dict:
    """What the conformance test asserts on, as lists of test ids and counts (unrun and unjudged tests left out)."""
    both = {t for t in ran(baseline) & ran(through) if judged(t, baseline)}
    base_pass, tfdist_pass = passed(baseline) & both, passed(through) & both
    fit_tests = {t for t in base_pass if calls_fit(baseline["tests"][t])}
    return {
        "unexpected": sorted(base_pass - tfdist_pass - set(known)),  # Broken through tfdist, not listed.
        "now_passing": sorted(t for t in known if t in tfdist_pass),  # Listed, but passes: drop it from the list.
        # Listed, but no baseline pass (renamed?); a listed test the sample or the file choice left out is not judged.
        "not_baseline": sorted(t for t in known if t not in base_pass and t in baseline["tests"]
                               and t in through["tests"]),
        "not_routed": sorted(t for t in fit_tests if not sum(through["tests"][t]["routed"].values())
                             and through["tests"][t]["outcome"] == "passed"),
        "keras_calls": sorted(t for t, r in through["tests"].items() if sum(r["keras"].values())),
        "scope_trouble": sorted(t for t, r in through["tests"].items() if r["scope_missing"] or r["scope_lost"]),
        "fit_tests": len(fit_tests),
        "fit_tests_passing": len(fit_tests & tfdist_pass),
        "baseline_passing": len(base_pass),
        "baseline_passing_through_tfdist": len(base_pass & tfdist_pass),
        # The tests that routed a call to tfdist, and those of them that passed (the broadened run's measure).
        "routed_tests": len({t for t in base_pass if sum(through["tests"][t]["routed"].values())}),
        "routed_tests_passing": len({t for t in tfdist_pass if sum(through["tests"][t]["routed"].values())}),
    }


def _where(record: dict) -> str:
    return " ".join(record.get(k) or "" for k in ("tfdist_frame", "test_frame")).strip() or record.get(
        "raised_at") or ""


def draft(baseline: dict, through: dict) -> list[str]:
    """Known-failure lines (category to fill in) for the baseline passes that fail through tfdist."""
    lines = []
    for test in sorted({t for t in passed(baseline) & ran(through) if judged(t, baseline)} - passed(through)):
        record = through["tests"].get(test, {"outcome": "missing"})
        lines.append(f"{test}  # ?: {record['outcome']} {record.get('error', '')[:200]} [{_where(record)}]")
    return lines


def mechanisms(through: dict, baseline: Optional[dict] = None) -> list[str]:
    """The tfdist mode's failures (baseline passes only, given a baseline), grouped by innermost tfdist frame."""
    groups: dict[str, list[str]] = collections.defaultdict(list)
    chosen = passed(baseline) if baseline is not None else set(through["tests"])
    for test, record in sorted(through["tests"].items()):
        if test in chosen and record["outcome"] in ("failed", "error"):
            key = record.get("tfdist_frame") or f"(no tfdist frame) {record.get('raised_at')}"
            groups[key].append(f"  {test}  -- {record.get('error', '')[:160]}")
    lines = []
    for key, tests in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"{key}: {len(tests)}")
        lines.extend(tests)
    return lines


def frames(excinfo: Any) -> dict[str, Optional[str]]:
    """The innermost tfdist frame, test-file frame and frame of a failure, as 'path:line in function'."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    site = os.path.dirname(keras_dir())
    found: dict[str, Optional[str]] = {"tfdist_frame": None, "test_frame": None, "raised_at": None}
    tb = excinfo.value.__traceback__ if excinfo is not None else None
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        shown = path
        for root in (site, repo):
            if path.startswith(root + os.sep):
                shown = os.path.relpath(path, root).replace(os.sep, "/")
                break
        text = f"{shown}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"
        found["raised_at"] = text
        if shown.startswith("tfdist/"):
            found["tfdist_frame"] = text
        if shown.startswith("keras/") and shown.endswith("_test.py"):
            found["test_frame"] = text
        tb = tb.tb_next
    return found


def sample(baseline: dict, through: dict) -> list[str]:
    """CI's sample (sample.txt): per broad file, its quickest test that calls fit/evaluate/predict in baseline.

    Quickest through tfdist of those that pass there (of those that fail, where none passes: a known failure).
    """
    best: dict[str, tuple[bool, float, str]] = {}
    for test in passed(baseline) & ran(through):
        name = test.split("::", 1)[0]
        if name.split("/", 1)[1] in FILES or not calls_fit(baseline["tests"][test]):
            continue
        record = through["tests"][test]
        key = (record["outcome"] != "passed", record["duration"], test)
        best[name] = min(best.get(name, key), key)
    return [f"{test}  # tfdist {duration:.1f} s{', fails' if failing else ''}"
            for failing, duration, test in sorted(best.values(), key=lambda key: key[2])]


def _load(paths: list[str]) -> dict:
    """One results file, or several merged (the later wins a test both ran)."""
    merged: dict = {"tests": {}}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        merged = {**data, "tests": {**merged["tests"], **data["tests"]}}
    return merged


def main(argv: list[str]) -> int:
    if argv[:1] == ["sample"] and len(argv) >= 3:
        print("\n".join(sample(_load(argv[1:2]), _load(argv[2:]))))
        return 0
    if argv[:1] in (["draft"], ["mechanisms"]) and len(argv) in (2, 3):
        loaded = []
        for path in argv[1:]:
            with open(path) as f:
                loaded.append(json.load(f))
        if argv[0] == "draft" and len(loaded) == 2:
            print("\n".join(draft(*loaded)))
            return 0
        if argv[0] == "mechanisms":
            print("\n".join(mechanisms(loaded[-1], loaded[0] if len(loaded) == 2 else None)))
            return 0
    print("usage: python -m tests.keras_conformance.results draft BASELINE.json TFDIST.json | "
          "mechanisms [BASELINE.json] TFDIST.json | sample BASELINE.json TFDIST.json [TFDIST.json ...]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Keras' own fit/evaluate/predict tests run through tfdist (the conformance run).

`files.py` names the installed Keras package's test files the run uses; `plugin.py` is a pytest plugin for a
subprocess that runs them either as they are (baseline) or with `fit`, `evaluate`, `predict` and the `*_on_batch`
methods routed through tfdist's functions under a 2-replica MirroredStrategy (`collection.py`: what it imports and
collects; `limits.py`: each test's time and memory limits); `results.py` reads and compares the two modes' results;
`known_failures.txt` lists the Keras tests that pass in baseline but not through tfdist, with the reason;
tests/test_keras_conformance.py runs both modes and compares them.
"""

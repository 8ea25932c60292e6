"""Keras' own fit/evaluate/predict tests run through tfdist (the conformance run).

`plugin.py` is a pytest plugin for a subprocess that runs test files of the installed Keras package, either
as they are (baseline) or with `fit`, `evaluate` and `predict` routed through `tfdist.fit`, `tfdist.evaluate`
and `tfdist.predict` under a 2-replica MirroredStrategy; `known_failures.txt` lists the Keras tests that pass
in baseline but not through tfdist, with the reason; tests/test_keras_conformance.py runs both modes and
compares them.
"""

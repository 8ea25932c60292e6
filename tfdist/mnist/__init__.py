"""The MNIST program behind `tfdist-train`: tfdist's first user of its own library.

`config` holds its frozen flag values, `data` and `idx` its digit sources (the
real digits bundled in `digits/`), `model` its CNN, `batching` its batch plan
and learning-rate schedule, and `train` builds all of them and calls `tfdist.fit`.
"""

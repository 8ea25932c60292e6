"""tfdist: TensorFlow/Keras 3 distributed training that works the same on every backend.

Entry points: `tfdist-train` (tfdist.cli.train), `tfdist-launch` (tfdist.cli.launch),
`tfdist-env` (tfdist.cli.env). Library: `tfdist.train.train_and_evaluate(TrainConfig(...))`.
Importing this package does not import TensorFlow.
"""

__version__ = "0.1.0"

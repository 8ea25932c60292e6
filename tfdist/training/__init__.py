"""The training library: `fitting.fit` (the public `tfdist.fit`) and what it is made of.

`steps` are the compiled inner loops (train/eval executions), `loop` the outer
loop (Orbit's Controller: epochs, evaluation, checkpoints, callbacks,
preemption), `inputs` the input pipelines, `workdir` the run directory and its
lock, `export` the serving export. Nothing here knows which model it trains.
"""

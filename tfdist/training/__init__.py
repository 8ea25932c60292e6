"""The training library: `fitting.fit`, `evaluating.evaluate` and `predicting.predict` (the public
`tfdist.fit`, `evaluate`, `predict`) and the parts they share. docs/layout.md ("Where does X happen") names
the module that does each thing.
"""

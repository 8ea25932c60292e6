"""A two-task job (MultiWorkerMirrored workers, or Horovod ranks) of the Keras forms in tests/keras_forms.py.

Each task trains the Siamese model on list inputs with synchronized BatchNormalization, the
endpoint model without y (validating on x alone), the Embedding model for 50 steps and the
sparse-input model; it
saves its initial Siamese weights to a file, as keras.io's MixUp example does, through
tfdist.task_path, and reads them back. Then it writes its weights to OUT/task{N}.npz.

  python tests/programs/keras_forms.py OUT [multi_worker_mirrored|horovod]
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import tfdist  # noqa: E402
from tests import keras_forms as forms  # noqa: E402
from tfdist.distribute import strategies  # noqa: E402


def main() -> None:
    out, name = sys.argv[1], sys.argv[2]
    strategy = tfdist.make_strategy(name, precision="float32")
    with strategy.scope():
        siamese, endpoint, embedding, uneven = forms.siamese(), forms.endpoint(), forms.embedding(), forms.endpoint()
        sparse = forms.sparse_input()
    initial = tfdist.task_path(os.path.join(out, "initial_weights.weights.h5"))
    siamese.save_weights(initial)
    siamese.load_weights(initial)
    siamese_history = forms.fit_siamese(tfdist.fit, siamese)
    endpoint_history = forms.fit_endpoint(tfdist.fit, endpoint, validation_data=(forms.ENDPOINT_X,))
    uneven_history = forms.fit_endpoint(tfdist.fit, uneven, batch_size=7)  # 4 and 3 examples a task.
    tfdist.fit(embedding, forms.IDS, forms.IDS_Y, batch_size=256, epochs=4, max_steps=50, verbose=0)
    sparse_history = forms.fit_sparse(tfdist.fit, sparse)
    weights = siamese.get_weights() + endpoint.get_weights() + uneven.get_weights() + embedding.get_weights() + \
        sparse.get_weights()
    history = {"siamese": siamese_history.history, "endpoint": endpoint_history.history,
               "uneven": uneven_history.history, "sparse": sparse_history.history}
    index = strategies.current_backend().worker_index
    np.savez(os.path.join(out, f"task{index}.npz"), *weights, history=json.dumps(history), initial=initial)


if __name__ == "__main__":
    main()

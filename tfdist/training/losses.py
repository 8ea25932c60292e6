"""How each part of a global batch computes its share of the one-device loss, and the masks evaluation adds."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import keras
import tensorflow as tf
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

from tfdist.errors import UserError


def forward_losses(model: keras.Model) -> list:
    """The ``add_loss`` values (activity regularisers included) of the forward pass just run.

    Outside a `StatelessScope` (evaluation) Keras keeps them on the layers; inside
    one (the training step's recording scope) in the scope, filtered by layer, as
    Keras filters them.
    """
    return [loss for layer in model._flatten_layers(include_self=True) for loss in layer._get_own_losses()]


@contextlib.contextmanager
def model_losses(model: keras.Model, added: list) -> Iterator[None]:
    """Makes ``model.losses`` inside a `StatelessScope` what Keras' own steps see.

    Inside a scope Keras looks for ``add_loss`` values in the scope, where a
    forward pass run outside it (or in another scope) left none: without this,
    activity regularisers and ``add_loss`` terms would silently drop out of the loss. Weight
    regularisers are computed here, inside the scope, as Keras computes them.
    """
    if not added:
        yield
        return
    before = model._losses_override
    model._losses_override = list(added) + model._get_regularization_losses()
    try:
        yield
    finally:
        model._losses_override = before


def mask_padding(y_pred: Any, mask: tf.Tensor) -> Any:
    """Gives every output a Keras mask that also excludes the padding rows (``mask`` 0, static shapes).

    Keras' losses and mean metrics read the mask of ``y_pred`` (`keras.src.losses.loss.apply_mask`):
    a ``sum_over_batch_size`` loss then divides by the real (unmasked) entries, as Keras does on the
    real examples alone. An output's own mask (``Embedding(mask_zero=True)``, per timestep) is kept
    and combined with the padding; an output without one gets the padding mask in the shape of its
    per-entry losses (all of the output's dimensions but the last). Without padding (every batch
    but a padded one) every factor this adds is exactly 1.
    """
    real = tf.cast(mask, tf.bool)
    for output in tf.nest.flatten(y_pred):
        own = get_keras_mask(output)
        rank = len(own.shape) if own is not None else max(1, len(output.shape) - 1)
        rows = tf.reshape(real, tf.concat([[-1], tf.ones([rank - 1], tf.int32)], 0))
        if own is not None:
            combined = tf.logical_and(tf.cast(own, tf.bool), rows)
        else:
            combined = tf.broadcast_to(rows, tf.shape(output)[:rank]) if len(output.shape) > 1 else real
        set_keras_mask(output, combined)
    return y_pred


MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def _overrides_compute_loss(model: keras.Model) -> bool:
    from keras.src.trainers.trainer import Trainer

    return type(model).compute_loss is not Trainer.compute_loss


def loss_kind(model: keras.Model, parts: int) -> str:
    """How a part's one-device loss becomes its share of the global batch's: "mean" or "sum".

    "mean": the whole loss scales by ``n_part / n_global`` (mean reductions,
    ``add_loss`` terms, a ``compute_loss`` override, whose value is taken as a
    mean over its batch). "sum": the compiled loss counts whole, ``model.losses``
    by ``n_part / n_global``. With one part (one replica, no accumulation) any
    loss is exact. Refuses (`UserError`) what no scaling makes exact when a
    global batch is split: reductions by the weight sum or none at all, and
    compiled losses that mix mean and sum reductions or a "sum" loss under a
    ``compute_loss`` override (their terms cannot be told apart).
    """
    compiled = getattr(model, "_compile_loss", None)
    flat = getattr(compiled, "_flat_losses", None) or []
    reductions = [getattr(getattr(entry, "loss", None), "reduction", "sum_over_batch_size") for entry in flat]
    kinds = {"mean" if r in MEAN_REDUCTIONS else "sum" if r == "sum" else None for r in reductions}
    if parts == 1 or not reductions or kinds == {"mean"}:
        return "mean"
    where = f"split over {parts} parts (replicas x grad_accum_steps)"
    if None in kinds:
        odd = sorted({str(r) for r in reductions if r not in MEAN_REDUCTIONS + ("sum",)})
        raise UserError(
            f"The compiled loss has reduction {', '.join(odd)}, which divides by each part's own sample-weight sum "
            f"(or does not reduce); with the global batch {where} no scaling gives the one-device gradient. Use "
            "reduction='sum_over_batch_size' (the default) or 'sum', or train on one replica with "
            "grad_accum_steps=1.")
    if len(kinds) > 1:
        raise UserError(
            f"The compiled losses mix reductions ({', '.join(sorted(set(map(str, reductions))))}); with the global "
            f"batch {where} tfdist scales a mean by each part's share of the examples and a sum by 1, and cannot "
            "tell their terms apart in the total. Give every output the same kind of reduction (e.g. all "
            "'sum_over_batch_size'), or train on one replica with grad_accum_steps=1.")
    if _overrides_compute_loss(model):
        raise UserError(
            f"{type(model).__name__} overrides compute_loss() and compiles a reduction='sum' loss; with the "
            f"global batch {where} tfdist takes compute_loss()'s value as a mean over its batch and cannot find "
            "the sum inside it. Use reduction='sum_over_batch_size' (or return a mean from compute_loss), or "
            "train on one replica with grad_accum_steps=1.")
    return "sum"

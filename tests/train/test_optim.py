"""Which optax transforms may run on flat shards."""

import optax
import pytest

from zeropp_jax.train.optim import check_elementwise


@pytest.mark.parametrize(
    "tx",
    [
        optax.adam(1e-3),
        optax.adamw(1e-3, weight_decay=0.1),
        optax.sgd(0.1, momentum=0.9, nesterov=True),
        optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)),
        optax.chain(optax.clip(1.0), optax.scale_by_adam(), optax.scale(-1e-3)),
        optax.lion(1e-4),
        optax.rmsprop(1e-3),
        optax.adagrad(1e-2),
    ],
    ids=["adam", "adamw", "nesterov", "schedule", "chain_clip", "lion", "rmsprop", "adagrad"],
)
def test_elementwise_transforms_accepted(tx):
    check_elementwise(tx)


@pytest.mark.parametrize(
    "tx",
    [
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
        optax.clip_by_global_norm(1.0),
        optax.lamb(1e-3),
        optax.lars(1e-3),
        optax.adafactor(1e-3),
        optax.adamw(1e-3, mask=lambda p: {k: v.ndim > 1 for k, v in p.items()}),
        # A threshold above every probe norm: the probe sees no clipping, the structure does.
        optax.chain(optax.clip_by_global_norm(1e30), optax.sgd(1e-4)),
        optax.apply_if_finite(optax.adam(1e-3), max_consecutive_errors=3),
    ],
    ids=["clip_global_norm+adam", "clip_global_norm", "lamb", "lars", "adafactor", "masked",
         "clip_above_every_probe", "apply_if_finite"],
)
def test_non_elementwise_transforms_rejected(tx):
    with pytest.raises(ValueError, match="not elementwise") as e:
        check_elementwise(tx)
    assert "clip_by_global_norm" in str(e.value)  # the message teaches

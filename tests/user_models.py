"""A user's model for the tests, in a module of its own: `elasjax launch --import user_models`
registers it in every process (the tests run with `tests/` on the path)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import elasjax

DIM, HIDDEN, CLASSES, N = 16, 32, 4, 512


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, keys, deterministic):
        h = nn.relu(nn.Dense(HIDDEN)(x))
        if not deterministic:  # per-sample dropout: keys come from the global sample ids
            keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.9, (HIDDEN,)))(keys)
            h = jnp.where(keep, h / 0.9, 0.0)
        return nn.Dense(CLASSES)(h)


def _data(_cfg):
    rs = np.random.RandomState(0)
    y = rs.randint(0, CLASSES, N).astype(np.int32)
    x = (rs.normal(size=(N, DIM)) + y[:, None]).astype(np.float32)
    return elasjax.ArraySource(train={"x": x, "y": y}, val={"x": x[:64], "y": y[:64]})


def _loss(params, batch, keys, weights, deterministic, layer_transform=None):
    logits = MLP().apply({"params": params}, batch["x"], keys, deterministic)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return jnp.sum(ce * weights)  # summed; the loop divides by the step's real samples


SPEC = elasjax.register_model(elasjax.ModelSpec(
    name="test-mlp",
    init_params=lambda key: MLP().init(
        {"params": key}, jnp.zeros((1, DIM)), jax.random.split(key, 1), True)["params"],
    logical_specs=lambda: {"Dense_0": {"kernel": P(None, "mlp"), "bias": P("mlp")},
                           "Dense_1": {"kernel": P("mlp", None), "bias": P(None)}},
    loss=_loss,
    example_shapes={"x": jax.ShapeDtypeStruct((DIM,), jnp.float32),
                    "y": jax.ShapeDtypeStruct((), jnp.int32)},
    data=_data,
    tensor_degrees=(1, 2),
), replace=True)

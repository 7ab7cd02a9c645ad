"""Models the loop can train: `model.type` -> a `ModelSpec` (the contract,
`elasjax.core.modelspec`).

`gpt` is elasjax's own decoder-only GPT, built from the `model` section's dimensions. A user's
model is registered once (`register`) and selected by its name; the `model` section's GPT
dimensions do not apply to it.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from ..core.modelspec import (
    ArraySource,
    DataSource,
    LayerStack,
    ModelSpec,
    names,
    register,
    registered,
)
from . import gpt
from .costmodel import ModelProfile

__all__ = [
    "ArraySource", "DataSource", "LayerStack", "ModelSpec", "get", "names", "profile", "register",
]


def get(model) -> ModelSpec:
    """The spec of a `ModelConfig` (or of a type name, for registered user models)."""
    name = model if isinstance(model, str) else model.type
    if name == "gpt":
        if isinstance(model, str):
            raise ValueError("models.get('gpt') needs the ModelConfig (its dimensions)")
        return gpt.spec(model)
    return registered(name)


def profile(model) -> ModelProfile:
    """The cost model's profile of `model.type`'s spec: the GPT's from its dimensions, a user
    model's its own (`ModelSpec.profile`) or, without one, from its parameter count."""
    spec = get(model)
    return spec.profile if spec.profile is not None else _derived_profile(spec)


@functools.lru_cache(maxsize=16)
def _derived_profile(spec) -> ModelProfile:
    """A registered model's profile from its parameter count (traced once per spec: the planner
    asks for every candidate)."""
    n = sum(x.size for x in jax.tree.leaves(jax.eval_shape(spec.init_params, jax.random.key(0))))
    width = None
    if spec.layers is not None:
        width = max(int(np.prod(spec.layers.activation_shape)), 1)
    return ModelProfile.from_params(n, width, spec.n_layers)

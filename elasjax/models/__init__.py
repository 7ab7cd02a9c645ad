"""Models the loop can train: `model.type` -> a `ModelSpec` (see `spec.py`).

`gpt` is elasjax's own decoder-only GPT, built from the `model` section's dimensions. A user's
model is registered once (`register`) and selected by its name; the `model` section's GPT
dimensions do not apply to it.
"""

from __future__ import annotations

from . import gpt
from .spec import ArraySource, DataSource, LayerStack, ModelSpec

_USER: dict[str, ModelSpec] = {}

__all__ = ["ArraySource", "DataSource", "LayerStack", "ModelSpec", "get", "names", "register"]


def register(spec: ModelSpec, *, replace: bool = False) -> ModelSpec:
    """Make `spec` selectable as `model.type: <spec.name>`. A name already taken is an error
    unless `replace` (the built-in `gpt` cannot be replaced)."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"register: expected a ModelSpec, got {type(spec).__name__}")
    if spec.name == "gpt":
        raise ValueError("register: the name 'gpt' is elasjax's GPT; choose another name")
    if spec.name in _USER and not replace and _USER[spec.name] is not spec:
        raise ValueError(
            f"register: a model named '{spec.name}' is registered already; pass replace=True"
        )
    _USER[spec.name] = spec
    return spec


def names() -> list[str]:
    return ["gpt", *sorted(_USER)]


def get(model) -> ModelSpec:
    """The spec of a `ModelConfig` (or of a type name, for registered user models)."""
    name = model if isinstance(model, str) else model.type
    if name == "gpt":
        if isinstance(model, str):
            raise ValueError("models.get('gpt') needs the ModelConfig (its dimensions)")
        return gpt.spec(model)
    if name not in _USER:
        raise ValueError(
            f"model.type = {name!r}; allowed values: {', '.join(names())} (register a model "
            "with elasjax.register_model first)"
        )
    return _USER[name]

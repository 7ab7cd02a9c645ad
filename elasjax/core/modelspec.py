"""What the loop needs of a model: a `ModelSpec` (a model is data, not code in elasjax).

The trainer (`elasjax.run`) plans, steps and recovers any model given as a `ModelSpec`:

- `init_params(key)`: the parameter pytree;
- `logical_specs()`: a pytree like the parameters of `PartitionSpec`s over *logical* axis names
  (`elasjax.core.mesh.LOGICAL_RULES`: e.g. `"mlp"`, `"heads"` or `"vocab"` split over `tensor`,
  `"embed"` or None replicated; a name outside the table is an error);
- `loss(params, batch, keys, weights, deterministic, layer_transform)`: the *summed weighted*
  loss of a micro-batch, `sum_i weights[i] * loss_i`, where `batch` holds the example arrays with
  a leading sample axis, `keys` one PRNG key per sample (derived from the global sample id:
  draw from these and nothing else) and `weights` is 1 for real samples, 0 for padding. The
  trainer divides the step's sum once by the step's total `count` (below), so the gradient is
  the same estimator on any mesh. `layer_transform` is None unless the spec has a layer stack;
- `example_shapes`: one example's arrays (`jax.ShapeDtypeStruct`, no sample axis);
- `data(data_config) -> DataSource`: dataset index -> example arrays, for the `train` and `val`
  splits. Which examples a step uses is elasjax's (a seeded permutation of global sample ids);
- `count(examples) -> [n]`: each example's share of the normaliser, on the host (tokens for a
  language model, real tokens under a mask, 1 per example for a classifier: the default);
- `tensor_degrees`: the tensor-parallel degrees the model's shapes allow (default: 1 only);
- `profile`: sizes for the cost model (`costmodel.ModelProfile`; default: from the parameter
  count, one "layer");
- `layers` (`LayerStack`) and `n_layers`: for pipelines, the model split into embed, a stack of
  blocks (`params["layers"]`, stacked along a leading layer axis) and head. A model without one
  runs data x tensor x ZeRO and gets a clear error if it asks for `parallel.stage > 1`.

Register a spec under its name (`elasjax.register_model(spec)`) and select it with
`model.type: <name>`; elasjax's GPT is the spec named `gpt`, built from the `model` section's
dimensions (`elasjax.models`). The registry of user models lives here, below `config`, so that a
config naming a registered model is checked when it is loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import numpy as np

PyTree = Any


class DataSource(Protocol):
    """A model's examples: `examples(idx, split)` -> {name: array [len(idx), ...]}."""

    n_train: int
    n_val: int

    def examples(self, idx: np.ndarray, split: str = "train") -> dict[str, np.ndarray]: ...


@dataclasses.dataclass(frozen=True)
class ArraySource:
    """Examples held in memory: `train` and `val` map names to arrays with a leading example
    axis (every name the same length within a split)."""

    train: Mapping[str, np.ndarray]
    val: Mapping[str, np.ndarray]

    def __post_init__(self):
        for split, arrays in (("train", self.train), ("val", self.val)):
            sizes = {k: len(v) for k, v in arrays.items()}
            if not sizes or len(set(sizes.values())) != 1 or 0 in sizes.values():
                raise ValueError(
                    f"ArraySource '{split}': every array needs the same, non-zero length; got {sizes}"
                )

    @property
    def n_train(self) -> int:
        return len(next(iter(self.train.values())))

    @property
    def n_val(self) -> int:
        return len(next(iter(self.val.values())))

    def examples(self, idx: np.ndarray, split: str = "train") -> dict[str, np.ndarray]:
        arrays = self.train if split == "train" else self.val
        return {k: np.asarray(v)[idx] for k, v in arrays.items()}


def _ones(examples: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.ones(len(next(iter(examples.values()))), np.float32)


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """A model split for pipelines (`parallel.stage` > 1): `params["layers"]` holds the blocks'
    parameters stacked on a leading layer axis; everything else belongs to the embed and head.

    - `embed(params, batch, keys, deterministic)`: a micro-batch's examples -> activations
      `[n, *activation_shape]` (`params` without `"layers"`);
    - `block(layer_params, x, keys, layer_id, deterministic)`: one block with one layer's
      (unstacked) parameters; `layer_id` is the global layer index (fold it into random draws);
    - `head_loss(params, x, batch, weights)`: the summed weighted loss of the activations;
    - `activation_shape`: one sample's activation between blocks (what stages send).
    """

    embed: Callable[..., jax.Array]
    block: Callable[..., jax.Array]
    head_loss: Callable[..., jax.Array]
    activation_shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class ModelSpec:
    """See the module docstring. Specs compare by identity (an executable compiled for one is
    never reused for another)."""

    name: str
    init_params: Callable[[jax.Array], PyTree]
    logical_specs: Callable[[], PyTree]
    loss: Callable[..., jax.Array]
    example_shapes: Mapping[str, jax.ShapeDtypeStruct]
    data: Callable[[Any], DataSource]
    count: Callable[[Mapping[str, np.ndarray]], np.ndarray] = _ones
    tensor_degrees: tuple[int, ...] = (1,)
    profile: Any = None
    layers: LayerStack | None = None
    n_layers: int = 1

    @property
    def pipeline(self) -> bool:
        """Can it be pipelined (has it a layer stack)?"""
        return self.layers is not None

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"ModelSpec.name = {self.name!r} must be a non-empty string")
        if 1 not in self.tensor_degrees:
            raise ValueError(
                f"ModelSpec '{self.name}': tensor_degrees {self.tensor_degrees} must include 1"
            )
        for k, v in self.example_shapes.items():
            if not isinstance(v, jax.ShapeDtypeStruct):
                raise TypeError(
                    f"ModelSpec '{self.name}': example_shapes['{k}'] is {type(v).__name__}; "
                    "allowed: jax.ShapeDtypeStruct"
                )
        reserved = {"weights", "key_ids", "counts"} & set(self.example_shapes)
        if reserved:
            raise ValueError(
                f"ModelSpec '{self.name}': example names {sorted(reserved)} are the trainer's; "
                "rename them"
            )


# -- the registry of user models ----------------------------------------------------------------

_USER: dict[str, ModelSpec] = {}

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


def registered(name: str) -> ModelSpec:
    """The spec registered as `name` (a user model; the GPT is built by `elasjax.models.get`)."""
    if name not in _USER:
        raise ValueError(
            f"model.type = {name!r}; allowed values: {', '.join(names())} (register a model "
            "with elasjax.register_model first)"
        )
    return _USER[name]

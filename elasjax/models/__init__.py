"""Model registry: `model.type` -> module with `init_params`, `logical_specs`, `token_losses`."""

from . import gpt

REGISTRY = {"gpt": gpt}


def get(name: str):
    if name not in REGISTRY:
        raise ValueError(f"model.type = {name!r}; allowed values: {', '.join(REGISTRY)}")
    return REGISTRY[name]

"""elasjax: elastic-native hybrid-parallel training on JAX.

When a device or a host fails, the job goes on at the next step without a restart: a smaller
mesh over the live devices, the state rebuilt on it from live copies only (surviving replicas,
then checksummed snapshots), verified bitwise, and the same computation as the fault-free run.

Two ways in:

- **the pieces**, for your own model, loss, optimizer and loop (`elasjax.elastic`):
  `plan_mesh` picks a mesh over the live devices; `ElasticState` keeps any pytree state
  (PRNG keys, integer, 64-bit and bf16 leaves included) elastic: `commit(state, step)` after each
  good step snapshots what a failure would lose, `recover()` rebuilds and verifies it on the new
  mesh; `opt_state_shardings` gives an optax state its parameters' shardings (any chain,
  Adafactor's factored statistics included); `zero_shardings` gives it the loop's ZeRO stages
  (`zero.stage` 1 and 3) as sharding edits over the data axis (`partition_over`);
  `pad_batch` and `sample_keys` keep the batch, the loss normalisation and the random numbers
  those of the fault-free run. Below them: `ShardStore` + `transition` (move what survives of
  any state onto new shardings) and `state_checksums`.
- **the loop**, `run(load_config(path))`: the trainer with planning by cost model, elasjax's
  ZeRO-1/2/3 storage, standby executables, async migration, checkpoints and both runtimes (one
  process with simulated failures; `elasjax launch` with real process deaths). It trains any
  model given as a `ModelSpec` (init, logical axis names, a loss over a weighted batch, its
  data; for pipelines a `LayerStack`) registered with `register_model` and selected by
  `model.type`; elasjax's GPT is the built-in `gpt` spec.

See docs/api.md and examples/. Everything not listed in `__all__` is internal.
"""

from typing import TYPE_CHECKING

# The public names, each from its module, imported at first use (PEP 562): a process that needs
# one part of the package does not pay for the rest. `elasjax launch`'s launcher and the
# coordination process import the config and the runtime only, not flax, orbax or the loop
# (experiments/RESULTS.md, "What a process pays to import elasjax").
_WHERE = {
    "CheckpointConfig": ".config", "Config": ".config", "ConfigError": ".config",
    "SnapshotConfig": ".config", "load_config": (".config", "load"),
    "opt_state_shardings": ".core.sharding",
    **{n: ".elastic" for n in (
        "Coverage", "ElasticState", "Recovery", "StandbyProgress", "StateMismatchError",
        "Step", "ZeroShardings", "host_value", "pad_batch", "partition_over", "plan_mesh",
        "put_batch", "sample_keys", "state_checksums", "zero_shardings")},
    "OptimizerMeaningError": ".layout.state",
    "RunSummary": ".loop.trainer", "run": ".loop.trainer",
    "ArraySource": ".models", "DataSource": ".models", "LayerStack": ".models",
    "ModelSpec": ".models", "register_model": (".models", "register"),
    "Event": ".observe.events", "StepInfo": ".observe.events",
    "RecoveryEvent": ".observe.metrics", "RecoveryRecord": ".observe.metrics",
    "TensorBoardWriter": ".observe.tensorboard",
    "transition": ".transfer.reshard",
    "ShardStore": ".transfer.shards", "TransferLog": ".transfer.shards",
    "UnrecoverableStateError": ".transfer.shards",
}


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'elasjax' has no attribute {name!r}")
    module, attr = where if isinstance(where, tuple) else (where, name)
    import importlib

    value = getattr(importlib.import_module(module, __name__), attr)
    globals()[name] = value  # the next use is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from .config import CheckpointConfig, Config, ConfigError, SnapshotConfig
    from .config import load as load_config
    from .core.sharding import opt_state_shardings
    from .elastic import (
        Coverage,
        ElasticState,
        Recovery,
        StandbyProgress,
        StateMismatchError,
        Step,
        ZeroShardings,
        host_value,
        pad_batch,
        partition_over,
        plan_mesh,
        put_batch,
        sample_keys,
        state_checksums,
        zero_shardings,
    )
    from .layout.state import OptimizerMeaningError
    from .loop.trainer import RunSummary, run
    from .models import ArraySource, DataSource, LayerStack, ModelSpec
    from .models import register as register_model
    from .observe.events import Event, StepInfo
    from .observe.metrics import RecoveryEvent, RecoveryRecord
    from .observe.tensorboard import TensorBoardWriter
    from .transfer.reshard import transition
    from .transfer.shards import ShardStore, TransferLog, UnrecoverableStateError

__all__ = [
    # the pieces
    "ElasticState",
    "Step",
    "Coverage",
    "Recovery",
    "StandbyProgress",
    "plan_mesh",
    "partition_over",
    "zero_shardings",
    "ZeroShardings",
    "opt_state_shardings",
    "pad_batch",
    "put_batch",
    "host_value",
    "sample_keys",
    "state_checksums",
    "ShardStore",
    "transition",
    "TransferLog",
    "SnapshotConfig",
    "CheckpointConfig",
    # errors
    "UnrecoverableStateError",
    "StateMismatchError",
    "ConfigError",
    "OptimizerMeaningError",
    # the loop
    "ModelSpec",
    "LayerStack",
    "ArraySource",
    "DataSource",
    "register_model",
    "Config",
    "load_config",
    "run",
    "RunSummary",
    "StepInfo",
    "Event",
    "RecoveryEvent",
    "RecoveryRecord",
    "TensorBoardWriter",
]

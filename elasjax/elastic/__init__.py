"""Elasticity for your own JAX state and train step: the *pieces* entry point.

You keep your model, your loss, your optax optimizer and your loop. At step boundaries you call:

- `plan_mesh(devices, axes)`: a mesh over the live devices (which axis sizes to use, spares;
  `meshes`);
- `ElasticState.commit(state, step)`: after a good step, record the state's checksums and
  snapshot the shards a failure would otherwise lose (buddy device / host memory copies;
  `state`);
- `ElasticState.recover(failed)`: after a failure, re-plan the mesh over the survivors, rebuild
  the state on it from live copies only (surviving replicas, then verified snapshots), and verify
  every leaf against the checksums of the last committed step. The state is bitwise the one that
  was committed, or recovery raises (`UnrecoverableStateError`, `StateMismatchError`); it never
  continues with re-initialised or partly stale values.

Any pytree of arrays works: float (f32, bf16, f64), integer (int32, int64), bool leaves and typed
PRNG keys. The state's layout is yours: a function `shardings(mesh)` returning a pytree of
`NamedSharding`s that matches the state, on any mesh axes. `zero_shardings(stage, ...)` gives
it the loop's ZeRO stages (1: optimizer state over the data axis; 3: parameters too) as
sharding edits (`partition_over`): the optimizer still sees the parameter structure, so any
optax transform keeps its meaning.

The computation stays the fault-free one when the step follows the consistency contract
(`contract`): the same global batch at every step (`pad_batch` pads it to the data degree with
weight-0 rows), the loss normalised by the global count of real items (not a mean over
replicas), and random draws keyed by (step, global sample id) (`sample_keys`).

Failures come in two kinds. In one process `simulate_failure` deletes every buffer on the failed
devices (the state's and the snapshots'), so recovery can only read what a real failure leaves.
Run as the processes of `elasjax launch SCRIPT.py`, a failure is a process that dies: each step
of the loop is the block of a `Step` (`ElasticState.steps`, `steps`), which a death interrupts on
every survivor; the state is recovered on the job's runtime (its detectors, fresh collectives,
transfers between processes) and the step redone.
"""

from ..transfer.coverage import Coverage
from ..transfer.shards import StateMismatchError, is_key
from ..compilation.pieces_standby import StandbyProgress
from .contract import host_value, pad_batch, put_batch, sample_keys, state_checksums
from .meshes import ZeroShardings, partition_over, plan_mesh, zero_shardings
from .records import Join, Recovery
from .state import ElasticState
from .steps import Step

__all__ = [
    "ElasticState",
    "Step",
    "Coverage",
    "Recovery",
    "Join",
    "StandbyProgress",
    "StateMismatchError",
    "pad_batch",
    "put_batch",
    "host_value",
    "partition_over",
    "zero_shardings",
    "ZeroShardings",
    "plan_mesh",
    "sample_keys",
    "state_checksums",
    "is_key",
]

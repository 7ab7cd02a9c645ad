"""Every use of JAX's private or experimental modules, in one place, each probed at first use.

elasjax needs six things JAX does not publish:

- **loading a serialized executable onto other devices** (`executable_loader`): a standby plan
  rebound to the survivors, or a renewed CPU client's executables reloaded, without a compile
  (`compilation.executables.rebind`). Fallback: None, and the callers compile instead.
- **one-call construction of a global array** from per-device values (`batched_put`): several times
  cheaper per leaf than `jax.make_array_from_callback` (experiments/RESULTS.md, "Figures moved
  from code comments"). Fallback: None, the public path.
- **whether JAX's backends have started** (`backends_initialized`): a setting read when the CPU
  client starts can only be made before. Fallback: None (unknown).
- **the coordination service in a process of its own, and joining it** under `elasjax launch`
  (`start_coordination_service`, `join_coordination_service`: what `jax.distributed.initialize`
  does, with the service outside the training processes), and **its key-value client**
  (`distributed_client`). No fallback: a clear error naming the JAX version tested.
- **a cluster's job parameters from its environment** (`cluster_params`, for `elasjax launch
  --cluster`): JAX's own detection of SLURM, Open MPI, Kubernetes and Cloud TPU jobs. No
  fallback: a clear error that says to pass the flags by hand.
- **the implementation of a typed PRNG-key dtype** (`key_impl_of`): a process that holds no
  shard of a key leaf (a restarted process admitted into a job) makes its empty view of it from
  the leaf's abstract value, where `jax.random.key_impl` wants an array. No fallback: a clear
  error.
- **serializing a compiled executable** (`serialize`, `jax.experimental.serialize_executable`) and
  **point-to-point transfers** (`jax.experimental.transfer`, in `runtime.p2p`): experimental, not
  private; a missing module is a clear error when the feature is used.

Tested with jax 0.10.2, 0.12.0.1 and 0.12.1. Each probe runs once per process.
"""

from __future__ import annotations

import functools
import io
from typing import Any, Callable

import jax
import numpy as np

TESTED = "0.10.2"


def _missing(what: str, err: Exception) -> RuntimeError:
    return RuntimeError(
        f"{what} is not available in jax {jax.__version__} ({type(err).__name__}: {err}); "
        f"elasjax was tested with jax {TESTED}"
    )


@functools.cache
def executable_loader() -> Callable[[tuple, tuple, list], Any] | None:
    """`load(serialized, old_ids, flat)`: a serialized executable (`serialize`) loaded with
    `flat` (devices in mesh order) as its device assignment, position i of `old_ids` -> flat[i];
    None where this JAX lacks the private pieces (the probe looks them up; it compiles nothing,
    so that a recovery that must compile nothing can call it). Uses
    `jax._src.compiler.get_compile_options` and a subclass of the unpickler of
    `jax.experimental.serialize_executable`; that a loaded executable gives the same bits as a
    compiled one is tested in tests/test_standby_baselines.py."""
    try:
        from jax._src import compiler
        from jax.experimental import serialize_executable as se

        base = se._JaxPjrtUnpickler
        get_options = compiler.get_compile_options
    except (ImportError, AttributeError):
        return None

    def load(serialized: tuple, old_ids: tuple, flat: list) -> Any:
        payload, in_tree, out_tree = serialized
        client = flat[0].client
        by_old_id = dict(zip(old_ids, flat))
        opts = get_options(
            1, len(flat), device_assignment=np.asarray(flat, dtype=object).reshape(1, -1),
            backend=client,
        )

        class Unpickler(base):
            def persistent_load(self, pid):
                if pid[0] == "device":
                    return by_old_id[pid[1]]
                if pid[0] == "exec":
                    return self.backend.deserialize_executable(
                        pid[1], executable_devices=self.execution_devices, compile_options=opts
                    )
                return super().persistent_load(pid)

        loaded = Unpickler(io.BytesIO(payload), client, flat).load()
        # jax 0.10's form: (executable, arguments, no_kwargs); 0.12's leads with its format's
        # version and ends with the constant arguments (the newest JAX crashed loading a
        # program of its own from the program store on the form of 0.10: experiments/
        # RESULTS.md, "The bitwise sweep")
        if len(loaded) == 3:
            (unloaded, args_info, no_kwargs), const_args = loaded, []
        else:
            _, unloaded, args_info, no_kwargs, const_args = loaded
        return jax.stages.Compiled(
            unloaded.load(), const_args, in_tree.unflatten(args_info), out_tree,
            no_kwargs=no_kwargs,
        )

    return load


def loads_in_a_multiprocess_job() -> bool:
    """Does `executable_loader` give working programs in a multi-process job on this JAX? On
    jax 0.10 (the suite's, tests/test_multiprocess.py) yes; on jax 0.12 a program compiled by
    one process and loaded by the others failed its first gloo collective, so there each
    process compiles for itself (.ci/smoke_newest_jax runs that launch)."""
    return executable_loader() is not None and jax.__version_info__ < (0, 11)


def serialize(compiled) -> tuple:
    """`jax.experimental.serialize_executable.serialize(compiled)`: (payload, in_tree, out_tree)."""
    try:
        from jax.experimental import serialize_executable as se
    except ImportError as e:
        raise _missing("jax.experimental.serialize_executable", e) from None
    return se.serialize(compiled)


@functools.cache
def batched_put() -> Callable | None:
    """`put(shape, sharding, values, devices)`: a global array from per-device values in one call
    (what `jax.make_array_from_callback` ends in, without its per-value Python checks), through
    `jax._src.core.update_aval_with_sharding` and `jax._src.interpreters.pxla.batched_device_put`.
    Probed on a tiny array; None (use the public path) if either moved or misbehaves."""
    try:
        from jax._src import core as jcore
        from jax._src.interpreters import pxla

        def put(shape, sharding, values, devices):
            aval = jcore.update_aval_with_sharding(
                jcore.ShapedArray(shape, values[0].dtype), sharding
            )
            return pxla.batched_device_put(aval, sharding, values, devices)

        dev = jax.local_devices()[0]
        probe = put((2,), jax.sharding.SingleDeviceSharding(dev), [np.arange(2.0)], [dev])
        if not np.array_equal(np.asarray(probe), np.arange(2.0)):
            return None
        return put
    except Exception:  # noqa: BLE001 - any change in the private API means: use the public one
        return None


def cluster_params(coordinator: str | None, num_processes: int | None,
                   process_id: int | None) -> tuple[str | None, int | None, int | None]:
    """(coordinator address, process count, this process's id), each taken from the cluster's
    environment where not given: what `jax.distributed.initialize()` detects (SLURM, Open MPI,
    Kubernetes, Cloud TPU), through JAX's private cluster detection (`jax._src.clusters`; a
    clear error where it is missing). Values no environment gives stay None."""
    try:
        from jax._src import clusters

        detect = clusters.ClusterEnv.auto_detect_unset_distributed_params
    except (ImportError, AttributeError) as e:
        raise _missing("cluster detection (jax._src.clusters.ClusterEnv); pass --coordinator, "
                       "--num-processes and --process-id instead", e) from e
    coordinator, num_processes, process_id, _ = detect(
        coordinator, num_processes, process_id, None, None, 300)
    return coordinator, num_processes, process_id


def start_coordination_service(bind: str, num_processes: int, heartbeat_timeout_s: int,
                               shutdown_timeout_s: int = 5):
    """JAX's coordination service (the key-value store and the task registry of a
    `jax.distributed` job) in this process, which takes no part in the job: a training process
    that dies then takes nothing with it (`runtime.coordinator`). Tasks are recoverable: one that
    disconnects does not end the others. Keep the returned object alive; its deletion stops the
    service. `jax.distributed.initialize` starts it only inside the job's process 0."""
    try:
        from jax._src.lib import _jax

        factory = _jax.get_distributed_runtime_service
    except (ImportError, AttributeError) as e:
        raise _missing("JAX's coordination service (jax._src.lib._jax."
                       "get_distributed_runtime_service)", e) from None
    return factory(bind, num_processes, heartbeat_timeout=heartbeat_timeout_s,
                   shutdown_timeout=shutdown_timeout_s, recoverable=True)


def join_coordination_service(address: str, process_id: int, num_processes: int,
                              init_timeout_s: int, heartbeat_timeout_s: int) -> None:
    """Join a `jax.distributed` job as process `process_id` of `num_processes` through a
    coordination service that runs elsewhere (`start_coordination_service`): what
    `jax.distributed.initialize` does, less starting the service in process 0. JAX's backends,
    created afterwards, read this state (`jax._src.distributed.global_state`)."""
    try:
        from jax._src import distributed as _dist
        from jax._src.lib import _jax

        state, factory = _dist.global_state, _jax.get_distributed_runtime_client
    except (ImportError, AttributeError) as e:
        raise _missing("jax.distributed's client state (jax._src.distributed.global_state, "
                       "jax._src.lib._jax.get_distributed_runtime_client)", e) from None
    if state.client is not None:
        raise RuntimeError("this process has joined a jax.distributed job already")
    client = factory(address, process_id, init_timeout=init_timeout_s, use_compression=True,
                     heartbeat_timeout=heartbeat_timeout_s)
    client.connect()
    state.coordinator_address = address
    state.process_id, state.num_processes = process_id, num_processes
    state.client = client


def distributed_client():
    """The coordination service's client that `jax.distributed.initialize` started (its
    key-value store carries elasjax's membership protocol); an error if not initialised."""
    try:
        from jax._src import distributed as _dist

        client = _dist.global_state.client
    except (ImportError, AttributeError) as e:
        raise _missing("jax.distributed's coordination client "
                       "(jax._src.distributed.global_state.client)", e) from None
    if client is None:
        raise RuntimeError("jax.distributed is not initialised; call initialize first")
    return client


def backends_initialized() -> bool | None:
    """Has JAX started its backends (its CPU client exists)? None where this JAX cannot say
    (`jax._src.xla_bridge.backends_are_initialized`)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return None


def key_impl_of(dtype):
    """The PRNG implementation of the typed-key `dtype` (`jax.random.key_impl` of an array of
    it), for `jax.random.wrap_key_data`."""
    try:
        return dtype._impl
    except AttributeError as e:
        raise _missing(f"the implementation of the PRNG-key dtype {dtype} (its _impl)", e) from None


def transfer_module():
    """`jax.experimental.transfer` (point-to-point pulls between processes, `runtime.p2p`)."""
    try:
        from jax.experimental import transfer
    except ImportError as e:
        raise _missing("jax.experimental.transfer", e) from None
    return transfer

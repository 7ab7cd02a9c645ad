"""How a process joins a multi-controller job: the settings every process of a job takes (each
defined once, `SETTINGS`: the flags of `elasjax launch` and of its workers, and the argv a worker
is started with), `RuntimeConfig`, the XLA flags, and `initialize` (`jax.distributed` through the
coordination process, `runtime.coordinator`). The runtime itself is
`multicontroller.MultiControllerRuntime`."""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any

import jax
from jax.errors import JaxRuntimeError

from ..config import LaunchConfig, check_launch
from ..core import jaxcompat
from .dispatch import SETTING, order_cpu_collectives

# set by the writer once the job's first guard completed: a process that starts after it is a
# restarted one, which rejoins (`membership`) instead of creating a CPU client at once
STARTED = "elasjax/started"


@dataclasses.dataclass(frozen=True)
class Setting:
    """A setting every process of a job takes: a field of the config's `launch` section
    (`config.LaunchConfig`: its meaning, default, type and bounds), of `RuntimeConfig` too, and
    the flag that sets it, on `elasjax launch` and on its workers alike."""

    field: str
    flag: str
    help: str
    metavar: str | None = None


def add_setting_flags(ap) -> None:
    """`SETTINGS` as flags of an argparse parser (types from `config.LaunchConfig`). A flag left
    out is None: the config's `launch` section decides (`resolve_settings`)."""
    import argparse

    hints = typing.get_type_hints(LaunchConfig)
    for s in SETTINGS:
        tp = hints[s.field]
        if tp is bool:
            ap.add_argument(s.flag, dest=s.field, action=argparse.BooleanOptionalAction,
                            default=None, help=s.help)
        elif typing.get_origin(tp) is typing.Literal:  # its values are the choices
            ap.add_argument(s.flag, dest=s.field, default=None, choices=typing.get_args(tp),
                            help=s.help)
        else:
            ap.add_argument(s.flag, dest=s.field, type=tp, default=None, metavar=s.metavar,
                            help=s.help)


def settings_of(args) -> dict[str, Any]:
    """The `SETTINGS` flags given (`add_setting_flags`), by field name; those left out are not
    in it."""
    return {s.field: getattr(args, s.field) for s in SETTINGS
            if getattr(args, s.field) is not None}


def resolve_settings(section: LaunchConfig, given: dict[str, Any]) -> dict[str, Any]:
    """Every setting's value: a flag `given` (`settings_of`) wins over the config's `launch`
    `section`. Checked as `RuntimeConfig` is made."""
    unknown = sorted(set(given) - {s.field for s in SETTINGS})
    if unknown:
        raise TypeError(f"unknown settings {unknown}; allowed: "
                        + ", ".join(s.field for s in SETTINGS))
    return {s.field: given.get(s.field, getattr(section, s.field)) for s in SETTINGS}


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How one process joins the job.

    Attributes:
      coordinator: `host:port` of the coordination service (the coordination process binds it,
        `runtime.coordinator`; no training process does).
      num_processes: processes in the job.
      process_id: this process, 0 .. num_processes - 1.
      platform: `cpu` (gloo collectives, `devices_per_process` fake devices) or `gpu`.
      devices_per_process: CPU devices per process (ignored on GPU).
      heartbeat_timeout_s, collective_timeout_s, liveness_interval_s, liveness_timeout_s,
        watch_exits, renew_collectives, death_notices, gloo_loop: the detector's settings, what
        `config.LaunchConfig` (the YAML section `launch`) says of each, its defaults and
        bounds (`config.check_launch`) too; the flags of `SETTINGS` set them.
      init_timeout_s: how long `initialize` waits for every process to connect.
      slow: `(process, factor, from_step, steps)`: make `process` `factor` times slower (it is
        stopped and resumed by SIGSTOP/SIGCONT, a slow host) for `steps` steps from step
        `from_step` (benchmarks of false positives); None: off.
    """

    coordinator: str
    num_processes: int
    process_id: int
    platform: str = "cpu"
    devices_per_process: int = 2
    heartbeat_timeout_s: int = LaunchConfig.heartbeat_timeout_s
    collective_timeout_s: int = LaunchConfig.collective_timeout_s
    init_timeout_s: int = 120
    liveness_interval_s: float = LaunchConfig.liveness_interval_s
    liveness_timeout_s: float = LaunchConfig.liveness_timeout_s
    slow: tuple[int, float, int, int] | None = None
    renew_collectives: str = LaunchConfig.renew_collectives
    watch_exits: bool = LaunchConfig.watch_exits
    death_notices: bool = LaunchConfig.death_notices
    gloo_loop: str = LaunchConfig.gloo_loop

    def __post_init__(self) -> None:
        host, sep, port = self.coordinator.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"coordinator {self.coordinator!r} must look like HOST:PORT")
        if self.num_processes < 1:
            raise ValueError(f"num_processes = {self.num_processes} must be >= 1")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id = {self.process_id}; allowed values: 0 .. {self.num_processes - 1}"
            )
        if self.platform not in ("cpu", "gpu"):
            raise ValueError(f"platform {self.platform!r}; allowed values: 'cpu', 'gpu'")
        if self.platform == "cpu" and self.devices_per_process < 1:
            raise ValueError(f"devices_per_process = {self.devices_per_process} must be >= 1")
        if self.init_timeout_s < 1:
            raise ValueError(f"init_timeout_s = {self.init_timeout_s} must be >= 1")
        flags = {st.field: st.flag for st in SETTINGS}
        check_launch(self.launch, lambda f: f"{flags[f]} (launch.{f})")
        if self.slow is not None:
            proc, factor, start, steps = self.slow
            if not (0 <= proc < self.num_processes and factor >= 1 and start >= 0 and steps >= 1):
                raise ValueError(
                    f"slow = {self.slow}: (process 0 .. {self.num_processes - 1}, factor >= 1, "
                    "from_step >= 0, steps >= 1)"
                )

    @property
    def launch(self) -> LaunchConfig:
        """The detector's settings as the config section that defines them."""
        return LaunchConfig(**{st.field: getattr(self, st.field) for st in SETTINGS})

    def settings_argv(self) -> list[str]:
        """This config's `SETTINGS` as the flags a worker is started with."""
        out = []
        for s in SETTINGS:
            v = getattr(self, s.field)
            if isinstance(v, bool):
                out.append(s.flag if v else "--no-" + s.flag[2:])
            else:
                out += [s.flag, str(v)]
        return out

    @property
    def host(self) -> str:
        return self.coordinator.rpartition(":")[0]


SETTINGS = (
    Setting("heartbeat_timeout_s", "--heartbeat-timeout",
            "the detector's slow timeout (the coordination service's own heartbeat timeout is "
            "this, 30 s at least)", "S"),
    Setting("collective_timeout_s", "--collective-timeout",
            "a CPU collective waiting longer fails: the backstop that releases survivors "
            "blocked in a collective (1 for the fast path)", "S"),
    Setting("liveness_interval_s", "--liveness-interval",
            "heartbeat period through the key-value store (the detector)", "S"),
    Setting("liveness_timeout_s", "--liveness-timeout",
            "a process silent this long and absent from a guard's barrier is dead", "S"),
    Setting("watch_exits", "--watch-exits",
            "the arbiter also learns of a same-host process's death from the kernel (a pidfd "
            "turns readable at its exit), with no timeout"),
    Setting("death_notices", "--death-notices",
            "a sidecar on each process's host announces its death to every peer at once (UDP), "
            "so a death on another host needs no heartbeat timeout"),
    Setting("renew_collectives", "--renew-collectives",
            "after a failure, start a new CPU client with fresh gloo communicators: auto (when a "
            "block was interrupted or collectives were shut down), always, never"),
    Setting("gloo_loop", "--gloo-loop",
            "the priority of each process's gloo event loop, which spins while a message waits "
            "for its receive: idle (SCHED_IDLE: cores nothing else wants) or normal"),
)


# XLA:CPU's pass that joins neighbouring all-reduces into one of several arrays. Over gloo such
# an all-reduce is no cheaper (each array is a collective of its own: experiments/RESULTS.md, "One
# collective per operand under launch"), and one whose arrays differ in size is the form that has
# cost a healthy survivor its life after a peer's death (gloo's "Received data size doesn't
# match expected size" on its network thread; the same launch test 6 of 7 with the combiner, 10
# of 10 passed without: RESULTS.md, "Aborts after the process is quiet"). Launch workers run
# without it; one process keeps it (no gloo there).
ALL_REDUCE_COMBINERS = ("cpu-all-reduce-combiner", "all-reduce-combiner")
_DISABLE_PASSES = "--xla_disable_hlo_passes"


def xla_flags(rc: RuntimeConfig, existing: str = "") -> str:
    """XLA_FLAGS for a worker: the caller's flags without a fake-device count (the count is
    `jax_num_cpu_devices`) or an older collective timeout, plus this job's timeout flags; on
    CPU, XLA's all-reduce combiners disabled (`ALL_REDUCE_COMBINERS` says why), added to any
    passes the caller disabled."""
    drop = ("--xla_force_host_platform_device_count", "--xla_cpu_collective_timeout_seconds")
    kept = [f for f in existing.split() if not f.startswith(drop)]
    if rc.platform == "cpu":
        kept.append(f"--xla_cpu_collective_timeout_seconds={rc.collective_timeout_s}")
        disabled = [p for f in kept if f.startswith(_DISABLE_PASSES + "=")
                    for p in f.partition("=")[2].split(",") if p]
        kept = [f for f in kept if not f.startswith(_DISABLE_PASSES + "=")]
        passes = list(dict.fromkeys([*disabled, *ALL_REDUCE_COMBINERS]))
        kept.append(f"{_DISABLE_PASSES}={','.join(passes)}")
    else:  # GPU: do not abort the process on a NCCL error; let live_devices handle it
        kept += ["--xla_gpu_nccl_terminate_on_error=false", "--xla_gpu_nccl_async_execution=true"]
    return " ".join(kept)


# The coordination service's own heartbeat timeout, at least: it is not the detector (the
# liveness heartbeat and the exit watch are), and a live process it times out is terminated
# (SIGABRT, "Unexpected heartbeat request from an already-in-error task") with no chance to
# recover, so it must stay well above any silence a live process can show: compiles on loaded
# cores starve heartbeat threads for seconds (a 5 s timeout killed live processes:
# experiments/RESULTS.md, "Multi-process observations"). The detector's own slow timeout
# (`--heartbeat-timeout`) decides deaths; a starved process is waited for up to this bound
# (tests/test_multiprocess.py::test_a_silent_peer_whose_cpu_time_advances_is_working_and_a_stopped_one_is_not).
COORDINATION_HEARTBEAT_S = 30
# The longest heartbeat silence waited for while a same-host peer's CPU time advances (a starved
# process, `Liveness.working`); the coordination service would end it soon after anyway
STARVED_MAX_S = COORDINATION_HEARTBEAT_S
def initialize(rc: RuntimeConfig) -> None:
    """Join the job. Must run before anything creates a JAX backend in this process."""
    os.environ["XLA_FLAGS"] = xla_flags(rc, os.environ.get("XLA_FLAGS", ""))
    if rc.platform == "cpu":
        # jaxlib 0.11+: a rank's collectives one at a time, as the in-process runtime does (a
        # process's local ranks share one Eigen pool; `runtime.dispatch`); inert on jaxlib 0.10
        order_cpu_collectives()
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_num_cpu_devices", rc.devices_per_process)
    else:
        os.environ.setdefault("XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE", "1")
    jax.config.update("jax_enable_recoverability", True)
    jax.config.update(SETTING, False)  # before the CPU client starts (`runtime.dispatch`)
    # the service runs in a coordination process of its own (`runtime.coordinator`), so that
    # no training process is irreplaceable
    jaxcompat.join_coordination_service(
        rc.coordinator, rc.process_id, rc.num_processes, rc.init_timeout_s,
        max(rc.heartbeat_timeout_s, COORDINATION_HEARTBEAT_S),
    )
    if kv_float(kv_client(), STARTED) is not None:
        return  # a restarted process: no CPU client until the job admits it (`membership`)
    if jax.process_count() != rc.num_processes:
        raise RuntimeError(
            f"jax.distributed reports {jax.process_count()} processes, expected {rc.num_processes}"
        )


def kv_client():
    """The coordination service client (key-value store), or an error if not initialised."""
    return jaxcompat.distributed_client()


def kv_float(client, key: str) -> float | None:
    try:
        return float(client.key_value_try_get(key))
    except JaxRuntimeError:  # NOT_FOUND: the key was never set
        return None

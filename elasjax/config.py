"""Typed, frozen run configuration loaded from YAML with dotted overrides.

Every section of a run is a frozen dataclass, so configs hash (a `Plan` built from them can be a
static `jit` argument) and every field has exactly one home. YAML files in `configs/` state only
what differs from the defaults below; `--set a.b=v` overrides are parsed as YAML values
(`--set faults=[]` turns faults off, `--set train.steps=5` sets an int).

The loader is strict on purpose: an unknown key or a value outside its allowed set is a
`ConfigError` that names the dotted key and lists what is allowed. Nothing is silently ignored,
clipped or defaulted, because an elastic run that quietly trains something other than what the
user asked for is worse than one that refuses to start.

Fields whose values later subsystems will extend (ZeRO stages, pipeline stages, recovery
strategies) accept only the values implemented in this version; the allowed set in the error
message is therefore always the truth.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from .modelspec import registered


class ConfigError(ValueError):
    """A config key or value is not allowed; the message names the key and the allowed values."""


# ---------------------------------------------------------------------------------------------
# Sections.


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """`type`: `gpt` (elasjax's decoder-only GPT, whose dimensions are the other fields;
    `d_model` must equal `n_heads * head_dim`) or the name of a model registered with
    `elasjax.register_model` (the other fields then do not apply and must stay unset)."""

    type: str = "gpt"
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_mlp: int = 256
    dropout: float = 0.1
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Token source. `stdlib`: byte tokens of the standard library's `.py` files (real text that
    ships with every Python); `synthetic`: a seeded, learnable pattern for unit tests."""

    source: Literal["stdlib", "synthetic"] = "stdlib"
    seed: int = 0
    val_fraction: float = 0.05
    max_bytes: int = 8_000_000
    synthetic_samples: int = 4096


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The run's length, batch, optimizer and evaluation.

    `optimizer`: empty for the built-in optimizer (AdamW with linear warmup and cosine decay to
    `lr / 10`, after global-norm clipping at `grad_clip`: `state.make_optimizer`), or
    `MODULE:ATTR` naming a user's optax optimizer (`state.load_optimizer`; `elasjax train|launch
    --optimizer MODULE:ATTR` sets it). `lr`, `warmup_steps` and `weight_decay` configure the
    built-in optimizer only, so with any other optimizer (this field, or `elasjax.run(...,
    optimizer=tx)`) they must keep their defaults: a value of theirs that would be silently
    unused is an error (`BUILTIN_OPTIMIZER_FIELDS`). `grad_clip` too, except in deterministic
    mode, where the step itself clips gradients by `grad_clip` with a layout-independent norm
    before any optimizer runs (0 turns that off); there, clip with `grad_clip` and not inside
    your optimizer, whose global norm would reduce in a layout-dependent order.
    """

    steps: int = 40
    global_batch: int = 32
    microbatches: int = 1  # micro-batches per data replica in the initial plan
    max_micro_batch: int = 0  # samples per replica per micro-batch after a change; 0 = initial
    lr: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 10
    eval_batches: int = 2
    # bitwise-reproducible across plans (see `step`): true, false, or "auto" (the default; null
    # means the same): on wherever the rest of the config allows it (`deterministic_obstacle`).
    # What the config asks for; the mode in force is `Config.deterministic`. A run's config.yaml
    # keeps "auto", so rerunning it decides the same way (test_config.py)
    deterministic: Union[bool, Literal["auto"], None] = "auto"
    canonical_micro_batch: int = 0  # deterministic mode: samples per canonical micro-batch
    optimizer: str = ""  # "" = built-in AdamW; MODULE:ATTR = a user's optax optimizer

    def __post_init__(self):
        if self.deterministic is None:  # null: the same as "auto", written as "auto"
            object.__setattr__(self, "deterministic", "auto")


# the TrainConfig fields that configure the built-in optimizer (`state.make_optimizer`) only
BUILTIN_OPTIMIZER_FIELDS = ("lr", "warmup_steps", "weight_decay", "grad_clip")


def unused_optimizer_fields(t: TrainConfig) -> list[str]:
    """The built-in optimizer's fields that a custom optimizer would leave unused although they
    differ from their defaults (`grad_clip` is used in deterministic mode: the step clips)."""
    defaults = TrainConfig()
    return [
        f"train.{name}" for name in BUILTIN_OPTIMIZER_FIELDS
        if getattr(t, name) != getattr(defaults, name)
        and not (name == "grad_clip" and t.deterministic is True)
    ]


def check_custom_optimizer(t: TrainConfig, optimizer: str) -> None:
    """ConfigError if `t` sets a field that `optimizer` (a custom one, by name) would not use."""
    unused = unused_optimizer_fields(t)
    if not unused:
        return
    clip = (
        "" if "train.grad_clip" not in unused else
        " For clipping, put optax.clip_by_global_norm in your optimizer (or use "
        "train.deterministic = true, where the step clips by train.grad_clip before any "
        "optimizer)."
    )
    raise ConfigError(
        f"config {', '.join(f'{u!r} = {getattr(t, u[6:])!r}' for u in unused)}: "
        f"{'these configure' if len(unused) > 1 else 'this configures'} the built-in AdamW, "
        f"which does not run: the optimizer is {optimizer}. Allowed values with a custom "
        f"optimizer: their defaults (remove them from the config and give your optimizer its "
        f"own learning rate, schedule and weight decay).{clip}"
    )


def optimizer_spec_ok(spec: str) -> bool:
    """`MODULE:ATTR` with a dotted module path and an attribute name."""
    mod, sep, attr = spec.partition(":")
    return bool(sep) and all(
        part.isidentifier() for part in [*mod.split("."), attr]
    )


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Initial layout and the rules of re-planning.

    `devices`: how many of the visible devices the job trains on (-1 = all but the spares).
    `data`, `tensor`: the initial mesh (-1 = whatever the planner picks for the rest). After a
    failure `replan: cost` lets the planner choose any (data, tensor) shape by its cost model;
    `keep_tensor` keeps the initial tensor degree and only shrinks `data`.

    `spares`: hot spare hosts (whole hosts of `devices_per_host` devices) the job holds on top of
    `devices`: live, outside the mesh, never absorbed into it at the start or by growth. When a
    host of the mesh fails, a spare host takes its place in the same mesh position (the same
    shape, schedule, partition and ZeRO layout: `planner.substitute_spares`), so the mesh keeps
    its size; once the spares are used up the job shrinks as without them. Under `elasjax
    launch` a host is a process: `--spares K` starts K extra processes.
    """

    devices: int = -1
    devices_per_host: int = 1
    data: int = -1
    tensor: int = 1
    stage: int = 1
    replan: Literal["cost", "keep_tensor"] = "cost"
    max_stage: int = 0  # largest stage count a re-plan may choose; 0 = parallel.stage
    min_stage: int = 1  # smallest stage count a re-plan may choose
    spares: int = 0  # hot spare hosts on top of `devices` (see the docstring)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline schedule over the `stage` axis and its micro-batches per data replica (0 = use
    `train.microbatches`)."""

    schedule: Literal["gpipe"] = "gpipe"
    microbatches: int = 0


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """ZeRO stage (0: replicated over `data`; 1: optimizer state partitioned; 2: + gradient
    accumulators partitioned; 3: + parameters partitioned, gathered per layer in the step) and
    the partition layout (`elasjax.zero`)."""

    stage: Literal[0, 1, 2, 3] = 0
    layout: Literal["contiguous", "interleaved"] = "interleaved"


@dataclasses.dataclass(frozen=True)
class RngConfig:
    """`per_sample`: keys fold in (step, global sample id), independent of the layout.
    `per_device`: the ablation; keys fold in the sample's slot on the mesh, as rank-seeded
    frameworks do, so a re-plan changes the random draws."""

    mode: Literal["per_sample", "per_device"] = "per_sample"


@dataclasses.dataclass(frozen=True)
class JoinConfig:
    """Devices that return to the job at a step boundary (repaired, or replaced in the same
    slot): exactly one of `devices` (device ids) or `hosts` (host indices; a host returns every
    device of it that has failed). Only devices of the job that are down at that step can
    return; they come back empty and are filled from live sources when the run grows onto them
    (`recovery.grow_min_gain`)."""

    devices: tuple[int, ...] = ()
    hosts: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class MtbfConfig:
    """A seeded failure-and-repair process for long runs (a fault entry's `mtbf`), resolved up
    front into ordinary failures and joins (`faults.resolve_schedule`), so recovery, growth, the
    events and `compare` see nothing new.

    Every `unit` (a `device`, or a `host` of `parallel.devices_per_host` devices) of the job
    fails on its own: its lifetime is exponential with mean `mtbf_steps` (per unit, not per job:
    with U units up the job sees a failure every `mtbf_steps / U` steps on average), measured in
    steps from the boundary where it came up (the entry's `at_step` for the units up then) and
    rounded up to the next step boundary (so a unit trains at least one step). A unit the process
    failed at step s returns `repair_steps` later (a `join` at step s + repair_steps, if the run
    is still going; `null`: never: the job only shrinks) and starts a new lifetime there.
    Failures stop after step `stop` (`null`: the run's last step); repairs do not.

    Rules that keep the schedule runnable: the process never fails a unit when that would leave
    fewer than `min_live` units up (that unit keeps running and draws a new lifetime; the skip is
    noted in the spec of the process's events); it fails and returns only units that are up or
    that it failed itself (a scripted failure of a unit stops its clock, a scripted join starts
    it). Each unit draws from its own stream of `seed`, so the same seed gives the same events,
    and scripted faults of one unit do not move the other units' failures. At a step boundary
    the process's returns come first, then the scripted entries of that step, then the process's
    failures.

    Why an entry of `faults` and not a section of its own: the schedule stays one list, ordered
    by `at_step` (here: the process's start) together with the scripted entries, so
    `--set faults=[]` turns it off for the fault-free reference run, and everything that checks
    the schedule (`faults.resolve_schedule` under either runtime, `elasjax launch`'s check
    before it starts processes) sees it."""

    mtbf_steps: float
    repair_steps: Optional[int]
    unit: Literal["device", "host"] = "device"
    seed: int = 0
    stop: Optional[int] = None
    min_live: int = 1


@dataclasses.dataclass(frozen=True)
class FaultConfig:
    """One scripted failure, or a return (`join`).

    Exactly one of: `devices` (device ids), `hosts` (host indices; a host is
    `parallel.devices_per_host` consecutive devices of the job; under `elasjax launch` a host is
    a process), `count` (+ `seed`: that many live devices drawn at random), or `kill_process`
    (`elasjax launch` only: a real SIGKILL of that process; the same as `--kill STEP:PROCESS`),
    or `stall_process` + `stall_s` (`elasjax launch` only: not a failure; that process sleeps
    `stall_s` seconds before it dispatches step `at_step`, alive and beating, a straggler: with
    a collective timeout shorter than the stall, its peers' collectives fail while every process
    is alive, and the step is retried on fresh collectives).

    `phase`: `step` fails the devices during step `at_step` (in one process: at the boundary
    before it; under launch: right after the process dispatched it, its collectives in flight);
    `recovery` fails them during the transfer of the recovery that another fault at the same
    step started, so that recovery has to start again from what is left; `cutover` (one
    process) fails them at the first step boundary at or after `at_step` where an async
    migration cuts over, right after the new plan is installed (a run that never cuts over
    then says so in its summary).

    `join` (instead of a failure; `JoinConfig`): devices that failed earlier return at the
    boundary before step `at_step` (phase `step`; one process only for now). A join must come
    before the failures of its step in the list.

    `mtbf` (instead of a failure; `MtbfConfig`): from the boundary before step `at_step` on,
    a seeded process fails devices or hosts and returns them after a repair time (one process
    only: its returns are joins). Its place in the list is its start step, like any entry's."""

    at_step: int
    devices: tuple[int, ...] = ()
    hosts: tuple[int, ...] = ()
    count: int = 0
    seed: int = 0
    kill_process: int = -1
    stall_process: int = -1  # `elasjax launch`: this process stalls, alive, for `stall_s`
    stall_s: float = 0.0
    phase: Literal["step", "recovery", "cutover"] = "step"
    join: Optional[JoinConfig] = None
    mtbf: Optional[MtbfConfig] = None


@dataclasses.dataclass(frozen=True)
class SnapshotConfig:
    """Per-step copies of the state a failure would otherwise lose: shards whose every holder
    sits on one host (ZeRO partitions, tensor slices or pipeline stages with no replica on
    another host). `buddy`: a device copy on another host; `host`: a copy in host memory, taken
    from the holder into its host's memory independently of any buddy copy, so it survives the
    buddy's loss. Under `elasjax launch` a host is a process whose memory dies with it, so the
    host copy is kept in another process's memory instead: the buddy's (with `buddy: false`, the
    process a buddy would be on), read from the copy sent to that process's device. It then
    survives what a buddy copy survives (the holder's process dying), not that process's death.
    `null` (the default) protects by itself: buddy copies when the job has two hosts or more,
    host copies when it has one host of two devices or more (they survive a device failure). A
    job of one device (no spare) takes none: no device would be left to restore them to, so its
    device's failure ends the run whatever is copied. Only unique shards are copied,
    so a plan with none costs nothing. Setting both to `false` opts out: a run whose plan leaves
    unique state then warns at start.

    `copies`: how many buddy copies of each unique shard, each on a different host other than
    the holder's, so that any `copies` hosts failing together leave one (default 1). Each copy
    adds the unique bytes once more to every step's traffic. Allowed: 1 .. hosts - 1 with buddy
    copies; more than 1 turns buddy copies on (`buddy: null`) and is an error with
    `buddy: false`."""

    buddy: Optional[bool] = None
    host: Optional[bool] = None
    copies: int = 1

    @property
    def auto(self) -> bool:
        """Left unset: the copies are decided from the topology (`resolved`)."""
        return self.buddy is None and self.host is None

    def resolved(self, n_hosts: int, n_devices: int) -> "SnapshotConfig":
        """The copies to take on a job of `n_hosts` hosts and `n_devices` devices, spares
        included (`null` decided)."""
        if self.auto:
            return SnapshotConfig(buddy=n_hosts >= 2, host=n_hosts < 2 and n_devices >= 2,
                                  copies=self.copies)
        buddy = self.copies > 1 if self.buddy is None else self.buddy
        return SnapshotConfig(buddy=bool(buddy), host=bool(self.host), copies=self.copies)

    def check(self, n_hosts: int, key: str = "snapshot") -> None:
        """Refuse a `copies` that cannot be placed on a job of `n_hosts` hosts (`ConfigError`
        naming `key.copies` and the allowed values)."""
        k = self.copies
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"config '{key}.copies' = {k!r}; allowed values: an integer >= 1 "
                              "(buddy copies of each unique shard, each on another host)")
        if k == 1:
            return
        if self.buddy is False:
            raise ConfigError(
                f"config '{key}.copies' = {k} asks for {k} buddy copies and '{key}.buddy' is "
                f"false; allowed values with buddy: false: copies = 1 (or set buddy: true)"
            )
        if k > n_hosts - 1:
            raise ConfigError(
                f"config '{key}.copies' = {k} needs {k} hosts besides each holder's, and this "
                f"job has {n_hosts} host(s); allowed values here: 1 .. {max(1, n_hosts - 1)}"
            )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax persistent checkpoints: the last rung of recovery. `dir: null` disables them.
    `resume_step`: start from a checkpoint in `dir` (-1 = the newest) instead of step 0."""

    dir: Optional[str] = None
    every: int = 10
    keep: int = 2
    resume_step: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class RecoveryConfig:
    """`strategy`: `elastic` (re-plan over every survivor, state from live copies and snapshots),
    or the baselines `checkpoint_restart` (restore the newest checkpoint onto the new plan and
    redo the lost steps) and `torchft_like` (drop the broken data replicas and their share of
    the global batch). `migration: blocking` moves layers before training resumes; `async` resumes at once on a
    fast-path plan that moves no layers, compiles the optimal plan in the background and cuts
    over to it at a step boundary. `prepare_transfers` plans, in a background thread, the
    transitions of the likeliest next failures (each single device and host, and a pending
    cut-over) from shard descriptions, so that recovery only executes copies.

    When devices return (a fault schedule's `join`), the run grows like an async migration: it
    keeps training on its plan, compiles the best plan over the bigger live set in the
    background and cuts over at a step boundary (the returned devices are filled from live
    sources). `grow_min_gain` says how eager that is: the least predicted relative step-time
    gain (0.05: at least 5% faster) for which the run grows; below it the returned devices stay
    spare and the `join` event says why. `grow_standby` compiles, in the background while some
    devices are down, the plan growth would pick if every device of the job returned (the
    likeliest growth: the repaired devices come back), and while every device is live the plan
    a rejoin after one of the likeliest failures would grow to (where that is not the current
    plan: `Contingencies.rejoin_plans`), so that a join finds it compiled (and a rejoining
    process is sent it) and the cut-over does not wait for a compile (one extra background
    compile per plan change); left out (null) it is on where dead processes come back by
    themselves (`worker_restarts` > 0).
    `grow_wait_steps`: a growth whose plan is still compiling this many steps after the join is
    waited for (the job stalls for the rest of the compile instead of finishing small; sooner
    where `max_fast_path_steps` is set and smaller); 0 never waits.
    `grow_interim`: when the best plan is not compiled on every process at the join, but the
    returned devices make possible a plan the run has stood on before (the start plan, one it
    left at a failure) that is predicted faster than the current one, cut over at once to such a
    plan on the most devices (among as many, the one that ran fastest) and to the best plan once
    it is compiled (`elasjax.cutover`).

    `worker_restarts` (`elasjax launch` only; `--worker-restarts N` sets it): a worker that
    dies is started again, at most this many times in all; the restarted process rejoins the
    running job, which grows back onto its devices (`elasjax.admission`). The fault schedule may
    then kill a process again after its death (its restarted incarnation), at most this many
    times."""

    strategy: Literal["elastic", "checkpoint_restart", "torchft_like"] = "elastic"
    migration: Literal["blocking", "async"] = "blocking"
    max_fast_path_steps: int = 0  # async: wait for the optimal plan after this many steps; 0 = never
    prepare_transfers: bool = True
    grow_min_gain: float = 0.05  # joins: the least predicted relative step-time gain to grow
    # compile the every-device plan in the background while some are down; null: where dead
    # workers restart (`worker_restarts` > 0, `grows_back`)
    grow_standby: Optional[bool] = None
    grow_wait_steps: int = 10  # joins: wait for the growth plan's compile after this many steps
    grow_interim: bool = True  # joins: a compiled earlier plan at once, the best one when compiled
    worker_restarts: int = 0  # launch: dead workers started again to rejoin, at most this many


@dataclasses.dataclass(frozen=True)
class StandbyConfig:
    """Background compilation of the plans recovery would need after each single-device and
    single-host failure of the current plan (`enabled`): all of them, unless `max_plans` caps
    their number (the first ones in device order, then hosts; the cap is logged).

    `enabled`: true, false, or `auto` (the default): on where the builds can run in a compile
    worker process (one process on the CPU backend, the built-in GPT and optimizer: `elasjax
    train configs/...`), beside training at a lower priority, so that a failure after they are
    done is a standby hit; off elsewhere: under `elasjax launch`, where every process would
    compile every plan of its own (4 processes on one host, 4 compiles of each), and where the
    builds could only run on a thread of the training process (`true` turns it on there).
    `standby_on` says which; the start line and the `start` event say what it builds.

    Each candidate device set gets its own executables, but with `rebind` (default) each
    program (plan shape) is compiled once and the other device sets load it with their own
    device assignment (`executables.rebind`, on CPU and GPU; a fraction of a compile), built first; the
    same for a recovery's cold build. Executables that are loaded (`rebind`, `cache_dir`) never
    donate their input state (XLA:CPU deadlocked running a loaded executable that donates; see
    `Trainer.donate`): the state is held twice while a step runs; `rebind: false` (and no
    `cache_dir`) donates. `depth: 2` also compiles the programs a second failure would need (one
    plan per program), so that the standby of the plan a recovery moves to is loads only.

    `compiler`: where the compiles run. `process`: a child process at a lower CPU priority
    (`elasjax.compilation.worker`; one process on the CPU backend, the built-in GPT and the
    trainer's optimizer): training steps come first, a recovery that needs another program ends
    the child's compile so that its own has every core, one it needs is waited for (at normal
    priority) only when the child is a quarter of a compile's CPU time into it, and ended and
    compiled here otherwise. `thread`: in the training process (a compile cannot be stopped and
    shares the cores: a recovery's compile can take twice as long). `auto` (default): `process`
    where it applies, else `thread`.

    `wait_at_start` blocks before step 0 until the standby is ready and the transitions of
    `recovery.prepare_transfers` are planned; `wait_after_recovery` blocks the same way after
    each recovery's first good step, until the new plan's standby is built (a second failure
    soon after the first is then a hit too); each pause is a `standby_ready` event, outside any
    MTTR (demos and benchmarks; a long job builds them while it trains). `warm` runs each
    executable built while training waits once on placeholder zeros, on the training thread (one
    process), so the first step after a hit runs at steady-state speed; executables built in
    the background are not warmed. `cache_dir` turns on JAX's persistent compilation cache
    there, so a restarted job (or the next run) loads executables instead of compiling them; on
    CPU its key includes the device assignment. XLA:CPU cannot serialize an executable the cache
    loaded, so such a program is not rebound to other device sets (they compile) and, after a
    new CPU client under launch, is built again through the cache instead of reloaded."""

    enabled: Union[bool, Literal["auto"]] = "auto"  # auto: on where a worker process builds (`standby_on`)
    # where background compiles run: "auto" (process where it applies, else thread),
    # "process" (a child process a recovery can stop, `compile_worker`), or "thread"
    compiler: Literal["auto", "process", "thread"] = "auto"
    max_plans: Optional[int] = None  # None: every likely failure's plan
    depth: int = 1  # failures ahead to cover: 1 or 2
    # build a device set's executables from its program compiled for other devices
    # (`executables.rebind`) instead of compiling; executables then never donate (see the docstring)
    rebind: bool = True
    # background builds stop past this fraction of the process's memory-mapping limit (Linux
    # vm.max_map_count; a loaded CPU executable holds hundreds of mappings)
    map_budget: float = 0.5
    warm: bool = True
    wait_at_start: bool = False
    wait_after_recovery: bool = False  # pause after each recovery until the standby is rebuilt
    cache_dir: Optional[str] = None  # JAX persistent compilation cache (process-wide setting)


@dataclasses.dataclass(frozen=True)
class HardwareConfig:
    """Device and link parameters of the planner's cost model (`costmodel`). They rank layouts;
    the defaults describe a nominal accelerator, not a measured machine."""

    name: str = "nominal"
    flops: float = 1.0e12  # sustained FLOP/s per device
    link_bw: float = 50.0e9  # bytes/s per device for collectives
    link_latency_s: float = 5.0e-6  # per collective hop
    micro_overhead_s: float = 2.0e-4  # fixed cost of one micro-batch (launch, scan step)
    memory_gb: float = 0.0  # per device; 0 = unlimited

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 2**30 if self.memory_gb > 0 else float("inf")


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    """Where the run's metrics go besides `metrics.jsonl` and `events.jsonl` (which are always
    written under `--out`). `tensorboard_dir`: TensorBoard scalars of the steps, recoveries,
    failure costs and goodput (`elasjax.tensorboard`; needs `pip install
    'elasjax[tensorboard]'`), written by the process that writes the jsonl files; null: none.
    `elasjax train|launch --tensorboard DIR` sets it."""

    tensorboard_dir: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run, one frozen dataclass per YAML section (see README, 'Configs')."""

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    zero: ZeroConfig = ZeroConfig()
    pipeline: PipelineConfig = PipelineConfig()
    rng: RngConfig = RngConfig()
    faults: tuple[FaultConfig, ...] = ()
    snapshot: SnapshotConfig = SnapshotConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    standby: StandbyConfig = StandbyConfig()
    hardware: HardwareConfig = HardwareConfig()
    metrics: MetricsConfig = MetricsConfig()

    @property
    def deterministic(self) -> bool:
        """The mode in force: `train.deterministic` where it says true or false; where it says
        "auto", on exactly where `deterministic_obstacle` finds nothing in the config alone (so
        every process under `launch` decides the same)."""
        asked = self.train.deterministic
        return asked if isinstance(asked, bool) else deterministic_obstacle(self) is None

    def replace(self, **sections: Any) -> "Config":
        return dataclasses.replace(self, **sections)


def standby_on(cfg: Config, no_worker: str | None) -> bool:
    """Is the standby on? `standby.enabled` true or false; `auto`: exactly where its compiles run
    in a compile worker process (`no_worker`: why one cannot build this run's plans, None where
    it can: `compilation.worker.unavailable`), which a recovery can stop and which shares no
    thread with training. Compiles on a thread of the training process, beside steps, are asked
    for explicitly: on XLA:CPU a collective of a step then waited past its 40 s rendezvous
    timeout for a participant (the classifier example, experiments/RESULTS.md)."""
    asked = cfg.standby.enabled
    if isinstance(asked, bool):
        return asked
    return no_worker is None and cfg.standby.compiler != "thread"


def grow_standby(cfg: Config) -> bool:
    """Is the plan of the likeliest growth compiled ahead (`recovery.grow_standby`; left out:
    where dead workers restart and rejoin, `recovery.worker_restarts` > 0)?"""
    g = cfg.recovery.grow_standby
    return cfg.recovery.worker_restarts > 0 if g is None else bool(g)


def deterministic_obstacle(cfg: Config, optimizer_object: bool = False) -> str | None:
    """Why `cfg` cannot train in deterministic mode, or None where it can. With
    `train.deterministic: auto` (the default) the mode is on exactly where this is None.
    `optimizer_object`: the run is given an optax optimizer object (`trainer.run(...,
    optimizer=tx)`), which the config does not name."""
    p = cfg.parallel
    top = p.max_stage or p.stage
    if top > 1 and not (p.stage >= 2 and p.min_stage >= 2):
        return ("its pipelines may re-plan to one stage (parallel.min_stage < 2), and a "
                "pipelined and an unpipelined step add gradients in different orders")
    if cfg.recovery.strategy == "torchft_like":
        return "recovery.strategy = 'torchft_like' is implemented for the default mode only"
    if cfg.train.optimizer or optimizer_object:
        return ("a custom optimizer's own reductions are not known to be layout-independent, "
                "and the deterministic step would clip by train.grad_clip before it")
    return None


def deterministic_by_default(cfg: Config) -> bool:
    """Is `cfg`'s mode decided by the default (`train.deterministic: auto`)?"""
    return cfg.train.deterministic == "auto"


def with_optimizer_object(cfg: Config) -> Config:
    """`cfg` for a run given an optax optimizer object, which the config does not name: a
    deterministic mode that only the default chose is turned off, written as
    `train.deterministic: false` (`deterministic_obstacle`); one the config asks for stays."""
    if not (cfg.deterministic and deterministic_by_default(cfg)):
        return cfg
    return cfg.replace(train=dataclasses.replace(cfg.train, deterministic=False))


def mode_line(cfg: Config, optimizer_object: bool = False) -> str:
    """One line that says which mode `cfg` trains in, and why where the default decided it."""
    auto = deterministic_by_default(cfg)
    if cfg.deterministic:
        return ("deterministic mode: every loss and the state bitwise equal to the fault-free "
                "run's across re-plans (the tensor degree is kept)"
                + (" (the default; train.deterministic=false turns it off)" if auto else ""))
    # an optimizer object turned the default off (`with_optimizer_object`): say why
    why = deterministic_obstacle(cfg, optimizer_object) if auto or optimizer_object else None
    return ("default mode: losses within 1e-5 of the fault-free run's per step"
            + (f" (not deterministic: {why})" if why else " (train.deterministic = false)"))


# ---------------------------------------------------------------------------------------------
# Building dataclasses from plain data, strictly.


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _describe(tp: Any) -> str:
    """How an error names the values of one alternative of a union."""
    if tp is bool:
        return "true, false"
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is Literal:
        return ", ".join(repr(a) for a in typing.get_args(tp))
    return f"a {_type_name(tp)}"


def build_dataclass(tp: Any, value: Any, key: str = "") -> Any:
    """Build `tp` (a dataclass, Literal, scalar, Optional or tuple type) from plain data, strictly:
    unknown keys and disallowed values raise `ConfigError` naming the dotted `key`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"config '{key}' must be a mapping, got {value!r}")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            where = f"'{key}'" if key else "the top level"
            raise ConfigError(
                f"unknown config key '{_join(key, unknown[0])}'; allowed keys in {where}: "
                f"{', '.join(fields)}"
            )
        kwargs = {}
        for name, f in fields.items():
            if name in value:
                kwargs[name] = build_dataclass(hints[name], value[name], _join(key, name))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"config '{_join(key, name)}' is required")
        return tp(**kwargs)
    if origin is Literal:
        if value not in args:
            raise ConfigError(
                f"config '{key}' = {value!r} is not allowed; allowed values: "
                f"{', '.join(repr(a) for a in args)}"
            )
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return build_dataclass(inner[0], value, key)
        for alternative in inner:  # e.g. `true | false | "auto"`: the first that takes it
            try:
                return build_dataclass(alternative, value, key)
            except ConfigError:
                pass
        allowed = [_describe(a) for a in args]
        raise ConfigError(f"config '{key}' = {value!r} is not allowed; allowed values: "
                          f"{', '.join(allowed)}")
    if origin is tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            if args and args[-1] is Ellipsis and not isinstance(value, (str, bytes)):
                value = [value]  # a single id where a list is expected: `devices: 3`
            else:
                raise ConfigError(f"config '{key}' must be a list, got {value!r}")
        return tuple(build_dataclass(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config '{key}' must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config '{key}' must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads `1e9` (no sign, no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config '{key}' must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config '{key}' must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config field type {_type_name(tp)} at '{key}'")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def to_dict(cfg: Any) -> Any:
    """Plain YAML-able data (tuples become lists)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    return cfg


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (YAML keeps the last
    silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: YAML's own error follows
                continue
            if first is not key_node.start_mark:
                raise _DuplicateKey(
                    None, None, f"key {key!r} given twice (first at line {first.line + 1}); "
                    "allowed: each key once", key_node.start_mark)
        return super().construct_mapping(node, deep)


def read_yaml(text: str, where: str) -> Any:
    """`text` parsed as YAML, keys unique; a syntax error or a repeated key is a `ConfigError`
    naming `where` (a file, or the `--set` override), the line and the column."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except _DuplicateKey as e:
        mark = e.problem_mark
        raise ConfigError(f"{where}: line {mark.line + 1}, column {mark.column + 1}: "
                          f"{e.problem}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = " ".join(x for x in (e.context, e.problem) if x)
        raise ConfigError(f"{where}: {at}not valid YAML: {what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None


def read_config_file(path: str | Path) -> dict:
    """A config file's top-level mapping (`read_yaml`); a path that is not a readable file is
    a `ConfigError` naming it."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{path}: is a directory; allowed: a YAML config file "
                          "(e.g. configs/demo.yaml)")
    if not p.exists():
        raise ConfigError(f"{path}: no such file; allowed: a YAML config file "
                          "(e.g. configs/demo.yaml)")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read as a text file ({e})") from None
    raw = read_yaml(text, str(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return raw


def apply_override(raw: dict, assignment: str) -> dict:
    """Apply one `a.b.c=value` override to raw config data; the value is parsed as YAML."""
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like key.path=value")
    path, text = assignment.split("=", 1)
    keys = path.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override key {path!r} is not a dotted key path")
    value = read_yaml(text, f"--set {assignment}") if text.strip() else None
    node = raw
    for i, k in enumerate(keys[:-1]):
        child = node.get(k)
        if child is None:
            child = node[k] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{path}': '{'.'.join(keys[: i + 1])}' is not a section")
        node = child
    node[keys[-1]] = value
    return raw


def from_dict(raw: Mapping[str, Any] | None) -> Config:
    cfg = build_dataclass(Config, dict(raw or {}), "")
    validate(cfg)
    return cfg


def load(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load a YAML config (or the defaults when `path` is None) and apply dotted overrides."""
    raw = read_config_file(path) if path is not None else {}
    for o in overrides:
        apply_override(raw, o)
    return from_dict(raw)


def dump(cfg: Config, optimizer: str | None = None) -> str:
    """YAML of `cfg`, as the run's `config.yaml`. With a custom optimizer (`train.optimizer`, or
    `optimizer`: the label of one passed to `run` in Python, written as `train.optimizer`) the
    built-in optimizer's fields it leaves unused are left out, so the file says only what ran;
    a label that is not MODULE:ATTR makes the file refuse to load, rather than train AdamW."""
    d = to_dict(cfg)
    if optimizer is not None:
        d["train"]["optimizer"] = optimizer
    if d["train"]["optimizer"]:
        for name in BUILTIN_OPTIMIZER_FIELDS:
            if not (name == "grad_clip" and cfg.deterministic):
                del d["train"][name]
    return yaml.safe_dump(d, sort_keys=False)


# ---------------------------------------------------------------------------------------------
# Semantic checks that need more than one field. Device-dependent checks (does device 9 exist?)
# happen in `faults.resolve_schedule` once the device count is known.


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config '{key}' {msg}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def allowed_tensor_degrees(model: ModelConfig) -> list[int]:
    """Tensor degrees the model allows: for the GPT they must divide heads, the MLP width and
    the vocab; a registered model states its own (`ModelSpec.tensor_degrees`)."""
    if model.type != "gpt":
        return sorted(registered(model.type).tensor_degrees)
    return [
        t
        for t in divisors(model.n_heads)
        if model.d_mlp % t == 0 and model.vocab_size % t == 0 and model.d_model % t == 0
    ]


def layer_count(m: ModelConfig) -> int:
    """The model's layers (what pipelines partition): the GPT's `n_layers`, or a registered
    model's `ModelSpec.n_layers`."""
    if m.type == "gpt":
        return m.n_layers
    return registered(m.type).n_layers


def _validate_model(m: ModelConfig) -> int:
    """Check the model section; returns the model's layer count (for the stage bounds)."""
    if m.type != "gpt":
        try:
            spec = registered(m.type)
        except ValueError as e:
            raise ConfigError(f"config 'model.type' {str(e).split('model.type ', 1)[-1]}") from None
        set_gpt = [
            f.name for f in dataclasses.fields(ModelConfig)
            if f.name != "type" and getattr(m, f.name) != f.default
        ]
        _require(
            not set_gpt, f"model.{set_gpt[0] if set_gpt else ''}",
            f"is a GPT dimension and model.type = '{m.type}' is a registered model; remove "
            "the model section's other keys",
        )
        return spec.n_layers
    for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "d_mlp"):
        _require(getattr(m, name) >= 1, f"model.{name}", "must be >= 1")
    _require(
        m.d_model % m.n_heads == 0,
        "model.d_model",
        f"= {m.d_model} must be a multiple of model.n_heads = {m.n_heads}",
    )
    _require(0.0 <= m.dropout < 1.0, "model.dropout", f"= {m.dropout} must be in [0, 1)")
    return m.n_layers


def validate(cfg: Config) -> None:
    """Check `cfg` section by section; raise a `ConfigError` naming the first bad field.

    The order of the sections below is the order of the checks, so a config with several
    errors always reports the same one first."""
    n_layers = _validate_model(cfg.model)
    _validate_model_data(cfg)
    _validate_train(cfg.train)
    _validate_data(cfg.data)
    _validate_parallel(cfg, n_layers)
    _validate_pipeline(cfg)
    _validate_snapshot(cfg.snapshot)
    _validate_checkpoint(cfg.checkpoint, cfg.train.steps)
    _validate_hardware(cfg.hardware)
    _validate_recovery(cfg)
    _validate_standby(cfg.standby)
    _validate_deterministic(cfg)
    _validate_faults(cfg)


def _validate_model_data(cfg: Config) -> None:
    """A registered model brings its own data: of the data section only the sampler's seed
    applies."""
    m = cfg.model
    if m.type == "gpt":
        return
    set_data = [
        f.name for f in dataclasses.fields(DataConfig)
        if f.name != "seed" and getattr(cfg.data, f.name) != f.default
    ]
    _require(
        not set_data, f"data.{set_data[0] if set_data else ''}",
        f"is the GPT's token data and model.type = '{m.type}' brings its own data "
        "(ModelSpec.data); allowed in the data section: seed",
    )


def _validate_train(t: TrainConfig) -> None:
    """The train section's bounds and its optimizer (`train.deterministic` and
    `train.canonical_micro_batch`: `_validate_deterministic`)."""
    _require(t.steps >= 1, "train.steps", "must be >= 1")
    _require(t.global_batch >= 1, "train.global_batch", "must be >= 1")
    _require(t.microbatches >= 1, "train.microbatches", "must be >= 1")
    _require(t.max_micro_batch >= 0, "train.max_micro_batch", "must be >= 0 (0 = initial size)")
    _require(t.lr > 0, "train.lr", "must be > 0")
    if t.optimizer:
        _require(
            optimizer_spec_ok(t.optimizer), "train.optimizer",
            f"= {t.optimizer!r}; allowed values: '' (the built-in AdamW) or MODULE:ATTR, ATTR "
            "an optax GradientTransformation or a zero-argument callable returning one",
        )
        check_custom_optimizer(t, f"'{t.optimizer}' (train.optimizer)")
    _require(t.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
    _require(t.eval_every >= 0, "train.eval_every", "must be >= 0 (0 = never)")
    _require(t.eval_batches >= 1, "train.eval_batches", "must be >= 1")


def _validate_data(d: DataConfig) -> None:
    _require(
        0.0 < d.val_fraction < 1.0, "data.val_fraction", "must be in (0, 1)"
    )


def _validate_parallel(cfg: Config, n_layers: int) -> None:
    """Device counts, spares, the tensor degree against the model, and the stage bounds
    against its `n_layers` layers."""
    m, p = cfg.model, cfg.parallel
    _require(p.devices == -1 or p.devices >= 1, "parallel.devices", "must be -1 (all) or >= 1")
    _require(p.devices_per_host >= 1, "parallel.devices_per_host", "must be >= 1")
    _require(p.spares >= 0, "parallel.spares", f"= {p.spares}; allowed values: an integer >= 0 "
             "(hot spare hosts held outside the mesh)")
    if p.spares:
        _require(
            p.devices == -1 or p.devices % p.devices_per_host == 0, "parallel.devices",
            f"= {p.devices} with parallel.spares = {p.spares}: spares are whole hosts, so the "
            f"trained devices must be whole hosts too; allowed values: -1 or a multiple of "
            f"parallel.devices_per_host = {p.devices_per_host}",
        )
        _require(
            cfg.recovery.strategy != "torchft_like", "parallel.spares",
            f"= {p.spares} with recovery.strategy = 'torchft_like', which drops broken replicas "
            "and never refills them; allowed values with torchft_like: 0",
        )
    _require(p.data == -1 or p.data >= 1, "parallel.data", "must be -1 (the rest) or >= 1")
    tensors = allowed_tensor_degrees(m)
    if p.tensor != -1 and p.tensor not in tensors:
        what = (
            f"(n_heads={m.n_heads}, d_mlp={m.d_mlp}, vocab_size={m.vocab_size})"
            if m.type == "gpt" else f"'{m.type}' (its ModelSpec.tensor_degrees)"
        )
        raise ConfigError(
            f"config 'parallel.tensor' = {p.tensor} does not divide the model {what}; allowed "
            f"values: -1, {', '.join(map(str, tensors))}"
        )
    if m.type != "gpt":
        if not registered(m.type).pipeline and max(p.stage, p.max_stage) > 1:
            raise ConfigError(
                f"config 'parallel.stage' = {p.stage} (max_stage {p.max_stage}): model "
                f"'{m.type}' has no layer stack (ModelSpec.pipeline is false), so it cannot be "
                "pipelined; allowed values: 1 (data x tensor x ZeRO only)"
            )
    _require(
        1 <= p.stage <= n_layers,
        "parallel.stage",
        f"= {p.stage}; allowed values: 1 .. {n_layers} (the model's layers)",
    )
    _require(
        0 <= p.max_stage <= n_layers,
        "parallel.max_stage",
        f"= {p.max_stage}; allowed values: 0 (= parallel.stage) .. {n_layers} (the model's layers)",
    )
    _require(
        1 <= p.min_stage <= max(p.max_stage or p.stage, p.stage),
        "parallel.min_stage",
        f"= {p.min_stage}; allowed values: 1 .. {max(p.max_stage or p.stage, p.stage)} "
        "(parallel.max_stage)",
    )


def _validate_pipeline(cfg: Config) -> None:
    """The pipeline section, and what ZeRO supports once plans may be pipelined."""
    p, z = cfg.parallel, cfg.zero
    _require(cfg.pipeline.microbatches >= 0, "pipeline.microbatches", "must be >= 0")
    if z.stage > 0 and (p.stage > 1 or p.max_stage > 1):
        _require(
            z.stage == 1,
            "zero.stage",
            f"= {z.stage} with pipelines (parallel.stage = {p.stage}, parallel.max_stage = "
            f"{p.max_stage}) is not available yet; allowed values with pipelines: 0, 1",
        )
        _require(
            z.layout == "interleaved",
            "zero.layout",
            f"= '{z.layout}' with pipelines is not available; allowed values with "
            "pipelines: 'interleaved' (each layer partitioned on its own)",
        )


def _validate_snapshot(s: SnapshotConfig) -> None:
    """The bounds that need no topology (`copies` against the host count: `SnapshotPool`)."""
    _require(s.copies >= 1, "snapshot.copies",
             f"= {s.copies}; allowed values: an integer >= 1 (buddy copies of each "
             "unique shard, each on another host)")
    _require(s.copies == 1 or s.buddy is not False, "snapshot.copies",
             f"= {s.copies} asks for buddy copies and 'snapshot.buddy' is false; "
             "allowed values with buddy: false: 1 (or set buddy: true)")


def _validate_checkpoint(c: CheckpointConfig, steps: int) -> None:
    """`steps`: the run's `train.steps` (the last step a resume may name is `steps - 1`)."""
    if c.dir is not None:
        _require(c.every >= 1, "checkpoint.every", "must be >= 1")
        _require(c.keep >= 1, "checkpoint.keep", "must be >= 1")
    if c.resume_step is not None:
        _require(c.dir is not None, "checkpoint.resume_step", "needs checkpoint.dir")
        _require(
            c.resume_step == -1 or 0 <= c.resume_step < steps,
            "checkpoint.resume_step",
            f"= {c.resume_step}; allowed values: null, -1 (newest), 0 .. {steps - 1}",
        )


def _validate_hardware(h: HardwareConfig) -> None:
    for name in ("flops", "link_bw"):
        _require(getattr(h, name) > 0, f"hardware.{name}", "must be > 0")
    _require(h.memory_gb >= 0, "hardware.memory_gb", "must be >= 0 (0 = unlimited)")


def _validate_recovery(cfg: Config) -> None:
    """The recovery strategy against the checkpoint, parallel, ZeRO and train sections, and
    the recovery section's bounds."""
    r, p, t = cfg.recovery, cfg.parallel, cfg.train
    if r.strategy == "checkpoint_restart":
        _require(cfg.checkpoint.dir is not None, "recovery.strategy",
                 "= 'checkpoint_restart' needs checkpoint.dir")
    if r.strategy == "torchft_like":
        _require(p.stage == 1 and cfg.zero.stage == 0 and not cfg.deterministic, "recovery.strategy",
                 "= 'torchft_like' is implemented for data x tensor plans with zero.stage = 0 and "
                 "train.deterministic = false")
    _require(r.max_fast_path_steps >= 0, "recovery.max_fast_path_steps", "must be >= 0")
    _require(isinstance(r.grow_wait_steps, int) and r.grow_wait_steps >= 0,
             "recovery.grow_wait_steps", f"= {r.grow_wait_steps!r}; allowed values: an integer "
             ">= 0 (0: never wait for a growth plan's compile)")
    _require(isinstance(r.worker_restarts, int) and r.worker_restarts >= 0,
             "recovery.worker_restarts", f"= {r.worker_restarts!r}; allowed values: an integer "
             ">= 0 (under `elasjax launch`: dead workers started again to rejoin; 0: never)")
    _require(0.0 <= r.grow_min_gain < 1.0, "recovery.grow_min_gain",
             f"= {r.grow_min_gain}; allowed values: 0 <= grow_min_gain < 1 (a "
             "relative step-time gain; 0 grows whenever the bigger plan is predicted faster)")


def _validate_standby(s: StandbyConfig) -> None:
    _require(s.max_plans is None or s.max_plans >= 1, "standby.max_plans",
             "must be null (every likely failure's plan) or >= 1")
    _require(0.0 < s.map_budget <= 0.9, "standby.map_budget",
             f"= {s.map_budget}; allowed values: 0 < map_budget <= 0.9 (a fraction of "
             "the process's memory-mapping limit)")
    _require(s.depth in (1, 2), "standby.depth",
             f"= {s.depth}; allowed values: 1 (the plans after one more failure), "
             "2 (and after a second one)")


def _validate_deterministic(cfg: Config) -> None:
    """The bitwise deterministic mode (`train.deterministic`, `train.canonical_micro_batch`)
    against the stage bounds."""
    t, p = cfg.train, cfg.parallel
    _require(t.canonical_micro_batch >= 0, "train.canonical_micro_batch", "must be >= 0")
    if cfg.deterministic:
        top = p.max_stage or p.stage
        _require(
            top <= 1 or (p.stage >= 2 and p.min_stage >= 2),
            "parallel.min_stage",
            f"= {p.min_stage} with train.deterministic = true and pipelines (parallel.stage = "
            f"{p.stage}, parallel.max_stage = {p.max_stage}): a pipelined and an unpipelined step "
            "add gradients in different orders, so every plan must be pipelined; allowed values: "
            "parallel.stage >= 2 and parallel.min_stage >= 2, or parallel.stage = 1 and "
            "parallel.max_stage <= 1",
        )


def _validate_faults(cfg: Config) -> None:
    """Each fault entry on its own (kind, step, join and `mtbf` fields), then their order."""
    for i, f in enumerate(cfg.faults):
        _validate_fault(f, f"faults[{i}]", cfg)
    steps = [f.at_step for f in cfg.faults]
    _require(steps == sorted(steps), "faults", "must be ordered by at_step")
    tb = cfg.metrics.tensorboard_dir
    _require(tb is None or tb.strip() != "", "metrics.tensorboard_dir",
             f"= {tb!r}; allowed values: null (no TensorBoard scalars) or a directory path")


def _validate_fault(f: FaultConfig, key: str, cfg: Config) -> None:
    """One fault entry, `key` its place in the config (`faults[i]`)."""
    t = cfg.train
    kinds = [bool(f.devices), bool(f.hosts), f.count > 0, f.kill_process >= 0,
             f.join is not None, f.mtbf is not None, f.stall_process >= 0]
    if sum(kinds) != 1:
        raise ConfigError(
            f"config '{key}' must name exactly one of 'devices', 'hosts', 'count' (+ 'seed') "
            "or 'kill_process' (a failure), or 'join' (devices that return), or 'mtbf' (a "
            "seeded failure-and-repair process), or 'stall_process' (+ 'stall_s': a straggler)"
        )
    _require((f.stall_process >= 0) == (f.stall_s > 0), f"{key}.stall_s",
             f"= {f.stall_s}: 'stall_process' needs 'stall_s' > 0 (seconds) and 'stall_s' "
             "needs 'stall_process'")
    if f.mtbf is not None:
        _validate_mtbf(f, key, cfg)
    if f.join is not None:
        if bool(f.join.devices) == bool(f.join.hosts):
            raise ConfigError(
                f"config '{key}.join' must name exactly one of 'devices' (device ids) or "
                "'hosts' (host indices)"
            )
        _require(f.phase == "step", f"{key}.phase",
                 f"= '{f.phase}' with 'join': devices return at a step boundary; allowed "
                 "values: 'step'")
        _require(cfg.recovery.strategy == "elastic", f"{key}.join",
                 f"needs recovery.strategy = 'elastic' (growing back is not implemented for "
                 f"'{cfg.recovery.strategy}'); allowed values of recovery.strategy with "
                 "joins: 'elastic'")
    _require(f.kill_process >= -1, f"{key}.kill_process", "must be a process index >= 0")
    _require(
        0 <= f.at_step < t.steps,
        f"{key}.at_step",
        f"= {f.at_step} is outside the run; allowed values: 0 .. {t.steps - 1} "
        f"(train.steps = {t.steps})",
    )
    _require(f.count >= 0, f"{key}.count", "must be >= 0")


def _validate_mtbf(f: FaultConfig, key: str, cfg: Config) -> None:
    """The fields of a fault entry's `mtbf` process that need no topology (see `MtbfConfig`)."""
    m, steps = f.mtbf, cfg.train.steps
    _require(f.seed == 0, f"{key}.seed",
             f"= {f.seed} with 'mtbf': the process's seed is '{key}.mtbf.seed'; allowed values "
             "here: 0 (unset)")
    _require(f.phase == "step", f"{key}.phase",
             f"= '{f.phase}' with 'mtbf': the process fails and returns units at step boundaries; "
             "allowed values: 'step'")
    _require(m.mtbf_steps > 0 and m.mtbf_steps != float("inf"), f"{key}.mtbf.mtbf_steps",
             f"= {m.mtbf_steps}; allowed values: a finite number > 0 (the mean steps between "
             "failures of one unit)")
    _require(m.repair_steps is None or m.repair_steps >= 1, f"{key}.mtbf.repair_steps",
             f"= {m.repair_steps}; allowed values: null (failed units never return) or an "
             "integer >= 1 (steps until a failed unit returns)")
    _require(m.stop is None or f.at_step <= m.stop < steps, f"{key}.mtbf.stop",
             f"= {m.stop}; allowed values: null (the run's end) or {f.at_step} .. {steps - 1} "
             f"(from the entry's at_step to the last step; train.steps = {steps})")
    _require(m.min_live >= 1, f"{key}.mtbf.min_live",
             f"= {m.min_live}; allowed values: an integer >= 1 (units the process leaves up)")
    if m.repair_steps is not None:
        _require(cfg.recovery.strategy == "elastic", f"{key}.mtbf.repair_steps",
                 f"= {m.repair_steps} returns units as joins, which need recovery.strategy = "
                 f"'elastic' (growing back is not implemented for '{cfg.recovery.strategy}'); "
                 "allowed values with another strategy: null (units never return)")

"""The run's configuration, one frozen dataclass per YAML section, and what the config alone
decides (the mode, the standby)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional, Union


class ConfigError(ValueError):
    """A config key or value is not allowed; the message names the key and the allowed values."""


# ---------------------------------------------------------------------------------------------
# Sections.


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """`type`: `gpt` (elasjax's decoder-only GPT, whose dimensions are the other fields;
    `d_model` must equal `n_heads * head_dim`) or the name of a model registered with
    `elasjax.register_model` (the other fields then do not apply and must stay unset).

    `remat`: what the GPT's layer loop keeps from its forward pass for the backward. `dots`:
    only the matrix products' outputs and the dropout masks, the rest (norms, activations,
    softmax, the masks' application) recomputed in the backward pass
    (`jax.checkpoint_policies.dots_saveable` and the masks by name, `gpt.REMAT_POLICY`); `none`:
    everything the backward pass reads; `auto` (default): `dots` (`Config.model_in_force`).
    The same arithmetic either way, recomputed rather than read (gradients equal to 1e-5:
    tests/test_gradients.py; the bits may differ, so runs compared bitwise use one setting, as
    every run of one config does). Device programs on 8 fake CPU devices, ms per step, `dots`
    against `none`: the deterministic mode 352 against 428 at 3.3M and 2327 against 2504 at
    25.5M, `train.deterministic=false` 348 against 401 and 2000 against 2213 (the plain JAX
    step 369-393 and 2158-2304; experiments/RESULTS.md, "The dropout masks kept"). Before the
    masks were kept, `dots` made the other mode slower, and `auto` was `none` there."""

    type: str = "gpt"
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_mlp: int = 256
    dropout: float = 0.1
    tie_embeddings: bool = False
    remat: Literal["auto", "dots", "none"] = "auto"

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
    the partition layout (`elasjax.plan.zero`).

    `shrink`: what an interleaved layout does when data ranks leave. `relayout` (default): a
    fresh layout over the survivors; recovery moves more of the optimizer state (rank-to-rank
    copies, across processes under `elasjax launch`, into new buffers while the old ones are
    still held), and every failure that leaves the same mesh shape leaves the same step program,
    compiled once and loaded onto each device set (`standby.rebind`): the ZeRO demo's standby
    compiles 2 programs for its 12 likely failures in one process, 1 for its 4 under launch
    (experiments/RESULTS.md, "The ZeRO standby: a shrink re-lays out"). `in_place`: the
    survivors keep their partitions where they are and the departed ranks' pieces are dealt out
    to them in a new tier; recovery copies only the lost bytes and reuses the survivors'
    buffers, but each failure leaves a layout, and so a program, of its own (12 compiles and 4
    for the same standbys) with one more tier. A no-movement fast path (`recovery.migration:
    async`) always keeps the partitions in place."""

    stage: Literal[0, 1, 2, 3] = 0
    layout: Literal["contiguous", "interleaved"] = "interleaved"
    shrink: Literal["in_place", "relayout"] = "relayout"  # when ranks leave (above)


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
    `recovery/plan`, `recovery/transfer`, `recovery/verify` fail them as that phase begins, in the
    recovery that another fault at the same step started, so that recovery has to start again
    from what is left (`recovery` is `recovery/transfer`); `recovery/first_step` fails them as the
    first step after that recovery is dispatched (the recovery goes on in the same event); `cutover` (one
    process) fails them at the first step boundary at or after `at_step` where an async
    migration cuts over, right after the new plan is installed (a run that never cuts over
    then says so in its summary); `admission` (`elasjax launch`, a `kill_process` with
    `recovery.worker_restarts`) kills that process as the first admission of a restarted process
    at a step boundary from `at_step` on moves the state (a restarted process never takes it).

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
    phase: Literal["step", "recovery", "recovery/plan", "recovery/transfer", "recovery/verify",
                   "recovery/first_step", "cutover", "admission"] = "step"
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
    it is compiled (`elasjax.loop.cutover`).

    `worker_restarts` (`elasjax launch` only; `--worker-restarts N` sets it): a worker that
    dies is started again, at most this many times in all; the restarted process rejoins the
    running job, which grows back onto its devices (`elasjax.loop.admission`). The fault schedule
    may then kill a process again after its death (its restarted incarnation), at most this many
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
    train configs/...`), beside training, never pausing it, so that a failure after they are
    done is a standby hit; on under `elasjax launch` with `share_compiles` (the built-in GPT
    and optimizer), where each program is compiled once for the job, in one process's compile
    worker, and loaded by the others onto every device set of its shape; off elsewhere, where
    the builds could only run on a thread of each training process (`true` turns it on there).
    `standby_on` says which; the start line and the `start` event say what it builds.

    Each candidate device set gets its own executables, but with `rebind` (default) each
    program (plan shape) is compiled once and the other device sets load it with their own
    device assignment (`executables.rebind`, on CPU and GPU; a fraction of a compile), built first; the
    same for a recovery's cold build. Executables that are loaded (`rebind`, `cache_dir`) never
    donate their input state (XLA:CPU deadlocked running a loaded executable that donates; see
    `Trainer.donate`): the state is held twice while a step runs; `rebind: false` (and no
    `cache_dir`) donates. `depth: 2` also compiles the programs a second failure would need (one
    plan per program), so that the standby of the plan a recovery moves to is loads only;
    `auto` (default): 2 where a job's processes share their compiles, 1 elsewhere
    (`standby_depth`).

    `compiler`: where the compiles run. `process`: a child process at normal priority, paced
    by `worker_share` (`elasjax.compilation.worker`; the CPU backend, the built-in GPT and the
    trainer's optimizer, in one process or under launch with `share_compiles`): a recovery that needs another program ends the child's compile so that its own has
    every core (in one process; under launch the compile goes on, other processes wait for
    it), one it needs is waited for (at normal priority) only when the child is a quarter of a
    compile's CPU time into it, and ended and compiled here otherwise. `thread`: in the
    training process (a compile cannot be stopped and shares the cores: a recovery's compile
    can take twice as long; under launch the job's steps all but stopped while one process
    compiled, experiments/RESULTS.md "A compile on a training process's thread stalls the
    job's steps"). `auto` (default): `process` where it applies, else `thread`.

    `worker_share`: the compile worker's pace (null, the default: unpaced). While training
    steps run beside it and nothing waits for the compile under way (a likely failure's plan),
    the child may use this fraction of the cores this process has (the host's divided among the
    job's processes on it), on average; past it the child is stopped until its budget grows
    back, and the rebinds this process builds beside the steps rest in proportion. A compile
    the run needs now (a recovery's, a cut-over's, or one training waits for: `wait_at_start`,
    `wait_after_recovery`) runs unpaced. On fake CPU devices a compile at any priority takes
    its CPU time from the steps: the pace spreads that time, it does not remove it. The demo's
    3,000 steps on 2 cores: unpaced, the steps beside the standby's builds 1.5x the steps
    without a standby, the standby ready at step 638; at 0.1, every window of 300 steps at most
    1.18x, the standby not ready by the end; the same wall either way (experiments/RESULTS.md,
    "The paced compile worker").

    `wait_at_start` blocks before step 0 until the standby is ready and the transitions of
    `recovery.prepare_transfers` are planned; `wait_after_recovery` blocks the same way after
    each recovery's first good step, until the new plan's standby is built (a second failure
    soon after the first is then a hit too); each pause is a `standby_ready` event, outside any
    MTTR (demos and benchmarks; a long job builds them while it trains). `warm` runs each
    executable the standby built once on placeholder zeros, so the first step after a hit runs
    at steady-state speed (one process): while training waits, on the training thread; built in
    the background, dispatched between two steps, one per step, to run on the devices in their
    turn (a step's work per executable, and one more copy of its plan's state while it runs).
    Under launch they are not warmed (every process would have to run the same ones in the same
    order). `cache_dir` turns on JAX's persistent compilation cache there, so a restarted job
    (or the next run) loads executables instead of compiling them; on CPU its key includes the
    device assignment. XLA:CPU cannot serialize an executable the cache
    loaded, so such a program is not rebound to other device sets (they compile) and, after a
    new CPU client under launch, is built again through the cache instead of reloaded.

    `share_compiles` (under `elasjax launch`): each program is compiled by the first process
    that needs it and loaded by the others from the coordination service's key-value store
    (`compilation.shared`), instead of compiled by every process; a process that cannot get it
    (its compiler died, or could not serialize it) compiles it itself.

    `programs_dir`: every plan compiled is kept there serialized (`compilation.store`), keyed
    by its program and everything its compiled code depends on (versions, backend, JAX settings,
    XLA flags, the host CPU), so that a supervised restart, a rejoining process and the next run
    of the same config load it instead of compiling; unlike JAX's cache (`cache_dir`), what it
    loads can be rebound and shipped, and one entry serves every device set of its program."""

    enabled: Union[bool, Literal["auto"]] = "auto"  # auto: on where a worker process builds (`standby_on`)
    # where background compiles run: "auto" (process where it applies, else thread),
    # "process" (a child process a recovery can stop, `compile_worker`), or "thread"
    compiler: Literal["auto", "process", "thread"] = "auto"
    # the compile worker's share of this process's cores while training steps run beside it and
    # nothing waits for its compile (a token bucket over its CPU time); null: unpaced
    worker_share: Optional[float] = None
    max_plans: Optional[int] = None  # None: every likely failure's plan
    depth: Union[int, Literal["auto"]] = "auto"  # failures ahead: 1, 2 or auto (`standby_depth`)
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
    share_compiles: bool = True  # under launch: one process compiles a program, the others load it
    # compiled programs kept across runs (`compilation.store`): "auto" (`$ELASJAX_CACHE_DIR/
    # programs`, else `~/.cache/elasjax/programs`), a directory, or null (none)
    programs_dir: Optional[str] = "auto"
    programs_max_mb: float = 2048.0  # the oldest-read entries go past this size


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
    failure costs and goodput (`elasjax.observe.tensorboard`; needs `pip install
    'elasjax[tensorboard]'`), written by the process that writes the jsonl files; null: none.
    `elasjax train|launch --tensorboard DIR` sets it."""

    tensorboard_dir: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How the processes of `elasjax launch` detect a death and keep their collectives usable
    (ignored in one process). Every process of a job takes the same values; each field is also
    a flag of `elasjax launch` and of its workers (`--heartbeat-timeout`, `--collective-timeout`,
    `--liveness-interval`, `--liveness-timeout`, `--[no-]watch-exits`, `--[no-]death-notices`,
    `--renew-collectives`, `--gloo-loop`: `runtime.startup.SETTINGS`), and a flag given wins over
    this section.

    `heartbeat_timeout_s`: a process missing heartbeats this long is declared dead at the slow
    barriers (the coordination service's own timeout is this, 30 s at least).
    `collective_timeout_s`: a CPU collective waiting longer fails (XLA's
    `--xla_cpu_collective_timeout_seconds`, whole seconds): the backstop that releases survivors blocked in a collective with a peer no other
    detector reported; a live peer later than this inside a step makes the step be retried on
    fresh collectives (docs/launch-internals.md). `liveness_interval_s`: every process writes
    its heartbeat key to the coordination service this often. `liveness_timeout_s`: a process
    silent this long and absent from a step's exit barrier, while the step failed on a process
    that reached it, is dead (elsewhere `heartbeat_timeout_s` applies; a same-host process whose
    CPU time advances is waited for). `watch_exits`: a same-host peer's death is learned from
    the kernel (a pidfd turns readable at its exit), with no timeout, and a process inside a
    block shuts its collectives down as soon as it no longer computes. `death_notices`: a
    sidecar on each process's host announces its death to every peer (UDP), so a death on
    another host needs no heartbeat timeout. `renew_collectives`: after a failure, replace the
    CPU client by one with fresh gloo communicators: `auto` (where a block was interrupted,
    collectives were shut down, or a step is retried), `always`, `never` (no abort and no retry
    either). `gloo_loop`: the priority of each process's gloo event-loop thread, which spins
    while a message waits for its receive: `idle` (SCHED_IDLE: it runs on cores nothing else
    wants; the demo's step under launch on 2 cores 0.13 s against 0.29 s) or `normal`
    (`runtime.collectives.quiet_gloo_loops`)."""

    heartbeat_timeout_s: int = 5
    collective_timeout_s: int = 8
    liveness_interval_s: float = 0.1
    liveness_timeout_s: float = 1.0
    watch_exits: bool = True
    death_notices: bool = True
    renew_collectives: Literal["auto", "always", "never"] = "auto"
    gloo_loop: Literal["idle", "normal"] = "idle"


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
    launch: LaunchConfig = LaunchConfig()

    @property
    def deterministic(self) -> bool:
        """The mode in force: `train.deterministic` where it says true or false; where it says
        "auto", on exactly where `deterministic_obstacle` finds nothing in the config alone (so
        every process under `launch` decides the same)."""
        asked = self.train.deterministic
        return asked if isinstance(asked, bool) else deterministic_obstacle(self) is None

    @property
    def model_in_force(self) -> ModelConfig:
        """The model section with `remat: auto` resolved: `dots` (see `ModelConfig.remat`)."""
        if self.model.remat != "auto":
            return self.model
        return dataclasses.replace(self.model, remat="dots")

    def replace(self, **sections: Any) -> "Config":
        return dataclasses.replace(self, **sections)


def standby_on(cfg: Config, no_worker: str | None, shares_compiles: bool = False) -> bool:
    """Is the standby on? `standby.enabled` true or false; `auto`: where its compiles run in a
    compile worker process (`no_worker`: why one cannot build this run's plans, None where it
    can: `compilation.worker.unavailable`), which a recovery can stop and which shares no
    thread with training; and where the processes of a job share their compiles
    (`shares_compiles`: under `elasjax launch` with `standby.share_compiles`), so that each
    program is compiled once in the job (in one process's compile worker where `no_worker` is
    None, else on a thread of that process). Compiles on a thread of
    a lone training process, beside steps, are asked for explicitly: on XLA:CPU a collective of
    a step then waited past its 40 s rendezvous timeout for a participant (the classifier
    example, experiments/RESULTS.md)."""
    asked = cfg.standby.enabled
    if isinstance(asked, bool):
        return asked
    if shares_compiles and cfg.standby.share_compiles:
        return True
    return no_worker is None and cfg.standby.compiler != "thread"


def standby_depth(cfg: Config, shares_compiles: bool) -> int:
    """How many failures ahead the standby covers (`standby.depth`); `auto`: 2 where the job's
    processes share their compiles (`elasjax launch`, `standby.share_compiles`), 1 elsewhere.
    Under launch a program is compiled once for the whole job, and a step is a fraction of a
    compile: after a first failure the new plan's next programs took longer to compile than
    the 40 steps to a second one (experiments/RESULTS.md, "One collective per operand under
    launch"), so they are compiled from the start. In one process a compile's worth of steps
    is far more steps, and the second program would cost every run a compile it rarely uses."""
    if cfg.standby.depth != "auto":
        return int(cfg.standby.depth)
    return 2 if shares_compiles and cfg.standby.share_compiles else 1


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

"""Semantic checks that need more than one field; each failure a `ConfigError` naming the key
and the allowed values."""

from __future__ import annotations

import dataclasses
import typing

from ..core.modelspec import registered
from .sections import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    FaultConfig,
    HardwareConfig,
    LaunchConfig,
    ModelConfig,
    SnapshotConfig,
    StandbyConfig,
    TrainConfig,
    check_custom_optimizer,
    optimizer_spec_ok,
)

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
    check_launch(cfg.launch)


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
    r, p = cfg.recovery, cfg.parallel
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
    _require(s.worker_share is None or (
        not isinstance(s.worker_share, bool) and 0.0 < s.worker_share <= 1.0),
        "standby.worker_share", f"= {s.worker_share!r}; allowed values: a fraction of the "
        "cores, 0 < worker_share <= 1, or null (the compile worker unpaced)")
    _require(s.max_plans is None or s.max_plans >= 1, "standby.max_plans",
             "must be null (every likely failure's plan) or >= 1")
    _require(s.programs_max_mb > 0, "standby.programs_max_mb",
             f"= {s.programs_max_mb}; allowed values: a size in MB > 0 (turn the store off with "
             "standby.programs_dir: null)")
    _require(s.programs_dir is None or str(s.programs_dir).strip() != "", "standby.programs_dir",
             "= ''; allowed values: auto, a directory, or null (no program store)")
    _require(0.0 < s.map_budget <= 0.9, "standby.map_budget",
             f"= {s.map_budget}; allowed values: 0 < map_budget <= 0.9 (a fraction of "
             "the process's memory-mapping limit)")
    _require(s.depth in (1, 2, "auto") and not isinstance(s.depth, bool), "standby.depth",
             f"= {s.depth!r}; allowed values: 1 (the plans after one more failure), "
             "2 (and after a second one), auto (2 where a job's processes share their "
             "compiles, else 1)")


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
    _require(f.phase != "admission" or (f.kill_process >= 0 and not (f.devices or f.hosts)),
             f"{key}.phase", "= 'admission' kills a process as an admission moves the state: "
             "give 'kill_process' (and nothing else to fail)")
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


def check_launch(c: LaunchConfig, name=lambda field: f"config 'launch.{field}'") -> None:
    """The `launch` section's bounds, wherever its values come from: the YAML section, or the
    flags of `elasjax launch` and its workers (`name(field)`: how the user spelled the field,
    a flag there; `runtime.startup.RuntimeConfig` checks its values here)."""
    def require(cond: bool, field: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{name(field)} = {getattr(c, field)!r}: {msg}")

    for f in ("heartbeat_timeout_s", "collective_timeout_s"):
        v = getattr(c, f)
        require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f,
                "allowed values: an integer >= 1 (seconds)")
    require(0.01 <= c.liveness_interval_s <= 5, "liveness_interval_s",
            "allowed values: 0.01 .. 5 (seconds)")
    require(c.liveness_timeout_s >= 3 * c.liveness_interval_s, "liveness_timeout_s",
            f"must be >= 3 x the liveness interval ({3 * c.liveness_interval_s:g} s): a "
            "heartbeat or two may be late")
    modes = typing.get_args(typing.get_type_hints(LaunchConfig)["renew_collectives"])
    require(c.renew_collectives in modes, "renew_collectives",
            "allowed values: " + ", ".join(modes))
    loops = typing.get_args(typing.get_type_hints(LaunchConfig)["gloo_loop"])
    require(c.gloo_loop in loops, "gloo_loop", "allowed values: " + ", ".join(loops))
    for f in ("watch_exits", "death_notices"):
        require(isinstance(getattr(c, f), bool), f, "allowed values: true, false")

"""Typed, frozen run configuration loaded from YAML with dotted overrides.

Every section of a run is a frozen dataclass, so configs hash (a `Plan` built from them can be a
static `jit` argument) and every field has exactly one home. YAML files in `configs/` state only
what differs from the defaults (`sections`); `--set a.b=v` overrides are parsed as YAML values
(`--set faults=[]` turns faults off, `--set train.steps=5` sets an int).

The loader is strict on purpose: an unknown key or a value outside its allowed set is a
`ConfigError` that names the dotted key and lists what is allowed. Nothing is silently ignored,
clipped or defaulted, because an elastic run that quietly trains something other than what the
user asked for is worse than one that refuses to start.

Fields whose values later subsystems will extend (ZeRO stages, pipeline stages, recovery
strategies) accept only the values implemented in this version; the allowed set in the error
message is therefore always the truth.

Three modules, one idea each: `sections` (the dataclasses, and what the config alone decides:
the mode, the standby), `checks` (the semantic checks across fields) and `reading` (YAML and
overrides in, strictly; YAML out). Everything is imported from `elasjax.config`.
"""

from .checks import (  # noqa: F401
    allowed_tensor_degrees,
    check_launch,
    divisors,
    layer_count,
    validate,
)
from .reading import (  # noqa: F401
    apply_override,
    build_dataclass,
    dump,
    from_dict,
    load,
    read_config_file,
    read_yaml,
    to_dict,
)
from .sections import (  # noqa: F401
    BUILTIN_OPTIMIZER_FIELDS,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    FaultConfig,
    HardwareConfig,
    JoinConfig,
    LaunchConfig,
    MetricsConfig,
    ModelConfig,
    MtbfConfig,
    ParallelConfig,
    PipelineConfig,
    RecoveryConfig,
    RngConfig,
    SnapshotConfig,
    StandbyConfig,
    TrainConfig,
    ZeroConfig,
    check_custom_optimizer,
    deterministic_by_default,
    deterministic_obstacle,
    grow_standby,
    mode_line,
    optimizer_spec_ok,
    standby_depth,
    standby_on,
    unused_optimizer_fields,
    with_optimizer_object,
)

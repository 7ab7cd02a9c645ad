"""The runtime interface (`elasjax.runtime.base.Runtime`): both runtimes define every member it
lists, and the trainer decides by declared capabilities, never by probing for a method."""

import inspect
import typing
from pathlib import Path

from elasjax.plan.planner import Topology
from elasjax.runtime.base import Runtime
from elasjax.runtime.inprocess import InProcessRuntime
from elasjax.runtime.multicontroller import MultiControllerRuntime

CAPABILITIES = ("kind", "failure_simulation", "donate", "device_failures", "step_sync",
                "shares_compiles",
                "host_copies_off_host", "devices_return", "rejoins")


def _members() -> tuple[set[str], set[str]]:
    methods = {n for n, v in vars(Runtime).items()
               if callable(v) and not n.startswith("_")}
    fields = set(typing.get_type_hints(Runtime))
    return methods, fields


def test_both_runtimes_define_every_member_of_the_protocol():
    methods, fields = _members()
    assert set(CAPABILITIES) <= fields
    assert {"guard", "inject", "joiners", "admit", "renew_collectives", "move"} <= methods
    for cls in (InProcessRuntime, MultiControllerRuntime):
        for name in methods:
            assert callable(getattr(cls, name, None)), (cls.__name__, name)
            ours = inspect.signature(getattr(Runtime, name)).parameters
            theirs = inspect.signature(getattr(cls, name)).parameters
            assert list(ours)[: len(ours)] == list(theirs)[: len(ours)], (cls.__name__, name)
        for name in CAPABILITIES:  # declared on the class, not discovered at run time
            assert name in vars(cls), (cls.__name__, name)
    # instance fields are set in __init__: the in-process runtime can be built here
    rt = InProcessRuntime(topology=Topology((0, 1), 2))
    try:
        assert isinstance(rt, Runtime)
        assert rt.rejoins is False and rt.joiners() == [] and rt.admission is None
    finally:
        rt.close()
    assert MultiControllerRuntime.rejoins is True


def test_the_trainer_asks_the_runtime_by_capability_not_by_hasattr():
    src = (Path(__file__).parents[1] / "elasjax" / "loop" / "trainer.py").read_text()
    assert "hasattr(self.rt" not in src and "getattr(self.rt" not in src


def test_a_verdict_crosses_the_key_value_store_unchanged():
    """The verdict is typed in the runtime and JSON in the store: process numbers come back as
    ints, tuples as tuples, every field as posted."""
    from elasjax.runtime.verdict import Verdict

    v = Verdict(failed=(1, 3), exited=(3,), exit_how={3: "pidfd on this host"},
                starved_s={2: 1.25}, silent_s={1: 2.5, 3: 0.1}, errors={0: "Gloo: boom"},
                timeout_s=1.0, where="exit", arrived={0: 0.0, 2: 0.31}, t_verdict=12.5,
                joining={1: "nonce-a"})
    assert Verdict.from_json(v.to_json()) == v
    assert v.errors_line(4) == "process 0: Gloo"


def test_each_detector_setting_is_defined_once_and_reaches_the_worker_unchanged():
    """`startup.SETTINGS` makes the flags of `elasjax launch` and of its workers, and
    the worker's argv: a non-default value of every setting survives the trip launcher ->
    argv -> worker parser -> RuntimeConfig."""
    import dataclasses

    from elasjax.launch.process import worker_parser
    from elasjax.runtime.startup import SETTINGS, RuntimeConfig

    rc = RuntimeConfig("127.0.0.1:1234", 4, 2, heartbeat_timeout_s=7, collective_timeout_s=3,
                       liveness_interval_s=0.2, liveness_timeout_s=1.5, watch_exits=False,
                       death_notices=False, renew_collectives="always", gloo_loop="normal")
    defaults = RuntimeConfig("127.0.0.1:1234", 4, 2)
    assert all(getattr(rc, s.field) != getattr(defaults, s.field) for s in SETTINGS)
    args = worker_parser().parse_args(["--coordinator", rc.coordinator, "--num-processes", "4",
                                       "--process-id", "2", *rc.settings_argv()])
    from elasjax.launch.process import settings_of

    again = RuntimeConfig(args.coordinator, args.num_processes, args.process_id,
                          **settings_of(args))
    assert again == rc
    assert {f.name for f in dataclasses.fields(RuntimeConfig)} >= {s.field for s in SETTINGS}


def test_the_launch_section_sets_the_detector_and_a_flag_given_wins():
    """The YAML section `launch` (`config.LaunchConfig`) defines each detector setting: its
    default is `RuntimeConfig`'s, its bounds are checked with the flag's name where a flag set
    it, with the key's in a config; a flag left out leaves the section's value."""
    import dataclasses

    import pytest

    from elasjax import config
    from elasjax.launch.process import worker_parser
    from elasjax.runtime.startup import SETTINGS, RuntimeConfig, resolve_settings, settings_of

    defaults = RuntimeConfig("127.0.0.1:1234", 4, 2)
    assert defaults.launch == config.LaunchConfig()
    assert {s.field for s in SETTINGS} == {f.name for f in dataclasses.fields(config.LaunchConfig)}
    cfg = config.load(None, ["launch.collective_timeout_s=3", "launch.watch_exits=false"])
    args = worker_parser().parse_args(["--coordinator", "h:1", "--num-processes", "4",
                                       "--process-id", "2", "--collective-timeout", "5"])
    assert settings_of(args) == {"collective_timeout_s": 5}
    got = RuntimeConfig("h:1", 4, 2, **resolve_settings(cfg.launch, settings_of(args)))
    assert got.collective_timeout_s == 5 and got.watch_exits is False
    assert got.heartbeat_timeout_s == config.LaunchConfig.heartbeat_timeout_s
    with pytest.raises(config.ConfigError,
                       match=r"config 'launch.collective_timeout_s' = 0: allowed values: an "
                             r"integer >= 1"):
        config.load(None, ["launch.collective_timeout_s=0"])
    with pytest.raises(ValueError, match=r"--liveness-timeout \(launch.liveness_timeout_s\) = "
                                         r"0.1: must be >= 3 x the liveness interval"):
        RuntimeConfig("h:1", 4, 2, liveness_timeout_s=0.1)
    with pytest.raises(TypeError, match="unknown settings \\['collective_timeout'\\]"):
        resolve_settings(cfg.launch, {"collective_timeout": 1})

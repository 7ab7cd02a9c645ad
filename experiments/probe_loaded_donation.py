"""Probe: a train step loaded from its serialized form, with and without input donation.

    .venv/bin/python experiments/probe_loaded_donation.py MODE DONATE STEPS
      MODE:   native (compiled for its devices) | rebound (compiled for other devices, loaded
              with its own device assignment, `executables.rebind`) | reloaded (compiled for its
              devices, serialized and loaded back)
      DONATE: donate | keep

The tests' tiny GPT (tests/conftest.py: its XLA settings too) on 7 of 8 fake CPU devices, STEPS
chained train steps. Why `Trainer.donate` is off wherever executables are loaded: here, on
2026-11-25 (jax 0.10.2), every donating run of a loaded step aborted in XLA:CPU's collective
rendezvous ("Termination timeout ... only 6 of 7 arrived", exit 134) within a few steps: 5 of 5
runs (rebound twice, one of them with XLA's optimizations on; reloaded three times, one of them
waiting for each step before the next); `native donate 60`, `rebound keep 200` and
`reloaded keep 200` finished (exit 0). The stuck rendezvous showed ranks
of one execution inside two different collectives at once. A probe, not a test: it aborts the
process when the deadlock happens.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_cpu_collective_call_terminate_timeout_seconds=15"
)
import conftest  # noqa: E402,F401 - 8 fake devices, the suite's XLA settings
from conftest import tiny_config  # noqa: E402

from elasjax.loop import trainer  # noqa: E402
from elasjax.compilation.executables import ExecutableCache, compile_plan, rebind  # noqa: E402
from elasjax.plan.planner import replan  # noqa: E402


def main() -> int:
    mode, donate, n = sys.argv[1], sys.argv[2] == "donate", int(sys.argv[3])
    cfg = tiny_config("faults=[]", "train.steps=8")
    t = trainer.Trainer(cfg, None, exe_cache=ExecutableCache())
    live = list(t.topo.device_ids)
    other = replan([d for d in live if d != 3], t.topo, cfg, t.initial, t.initial)
    plan = replan([d for d in live if d != 2], t.topo, cfg, t.initial, t.initial)
    if mode == "native":
        exe = compile_plan(cfg, t.factory, plan, t.devices, donate=donate)
    elif mode == "rebound":
        exe = rebind(compile_plan(cfg, t.factory, other, t.devices, donate=donate), plan, t.devices)
    elif mode == "reloaded":
        exe = rebind(compile_plan(cfg, t.factory, plan, t.devices, donate=donate), plan, t.devices)
    else:
        raise SystemExit(f"MODE must be native, rebound or reloaded, got {mode!r}")
    state = exe.init()
    batch = exe.put_batch(t.data.batch(0, plan).arrays())
    t0, mets = time.time(), []
    for _ in range(n):
        state, met = exe.train(state, batch)
        mets.append(met)
        if len(mets) > 2:
            float(mets.pop(0)["loss"])
    print(f"{mode} {'donate' if donate else 'keep'}: {n} steps in {time.time() - t0:.1f}s, "
          f"loss {float(mets[-1]['loss']):.6f}")
    t.rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""On one accelerator: the per-device costs of elasjax's protection that carry over to a cluster.

    python experiments/gpu_costs.py [--size 350m|1b|tiny] [--steps 8] [--out results/gpu_costs]

On the first device of the default backend (run it where a GPU is at hand; `--size tiny` runs
anywhere, in seconds, to check the script), for a GPT of ~0.35B (`350m`: d_model 1024, 24
layers) or ~1B (`1b`: d_model 2048, 18 layers) parameters, one device, batch 8 x 512 tokens:

  step, plain          a jitted train step (AdamW, the same loss), the state donated
  step, elasjax        elasjax's train step: the same, plus the on-device checksums of the new
                       state (`StateLayout.stacked_checksums`, each element hashed once)
  snapshot, serial     after each step, the whole state copied to host memory and waited for
  snapshot, overlapped the copy started right after the step is dispatched (`copy_to_host_async`)
                       and collected after the next step is dispatched, as the trainer's host
                       rung does on an accelerator
  device->host         one array of the state's bytes copied to host memory: the link the
                       snapshot rows are bound by (its GiB/s is printed in the header)

On an accelerator a row "checksums in CPU-sized tiles" also gives the checked step compiled with
the CPU's checksum tile size (`checksum.CHUNK`), which accelerators used before
`checksum.tile_elements` chose larger tiles there.

Each figure is the median per-step time over `--steps` steps after 2 warm-up steps, in one
process, side by side; ratios are to "step, plain". The card's name is printed with them; the
results go to `--out` (JSON and a markdown line for experiments/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from elasjax import config  # noqa: E402
from elasjax.loop.data import DataPipeline  # noqa: E402
from elasjax.core.mesh import make_mesh, replicated  # noqa: E402
from elasjax.plan.planner import Topology, initial_plan  # noqa: E402
from elasjax.core.sharding import batch_shardings  # noqa: E402
from elasjax.layout.state import StateFactory, TrainState, make_optimizer  # noqa: E402
from elasjax.layout.step import abstract_batch, make_grad_fn  # noqa: E402
from elasjax.transfer import checksum  # noqa: E402

LINK = "device->host copy of the state's bytes (one array)"
SIZES = {"tiny": (64, 2, 4, 64, 8), "350m": (1024, 24, 16, 512, 8), "1b": (2048, 18, 16, 512, 8)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="350m", choices=list(SIZES))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="results/gpu_costs")
    args = ap.parse_args(argv)
    d, layers, heads, seq, batch = SIZES[args.size]
    cfg = config.load(None, [
        f"model.d_model={d}", f"model.n_layers={layers}", f"model.n_heads={heads}",
        f"model.d_mlp={4 * d}", f"model.seq_len={seq}", "data.source=synthetic",
        "train.deterministic=false",
        f"train.global_batch={batch}", "train.microbatches=1", f"train.steps={args.steps + 2}",
        "parallel.devices=1", "parallel.data=1", "parallel.tensor=1", "faults=[]",
    ])
    dev = jax.devices()[0]
    plan = initial_plan(Topology((dev.id,), 1), cfg)
    f = StateFactory(cfg, make_optimizer(cfg))
    mesh = make_mesh(plan.mesh_shape, [dev])
    layout = f.layout(plan)
    sh = layout.shardings(mesh)
    ab = abstract_batch(plan, f.model)
    bsh = batch_shardings(mesh, ab)
    grad_fn = make_grad_fn(cfg, f.model, mesh, sh, layout)
    tx = f.tx

    def plain(state, b):
        loss, grads = grad_fn(state.params, b, state.step)
        updates, opt = tx.update(grads, state.opt_state, state.params)
        return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt), loss

    def checked(state, b):
        new, loss = plain(state, b)
        return new, (loss, layout.stacked_checksums(new, mesh))

    rep = replicated(mesh)
    step_plain = jax.jit(plain, in_shardings=(sh, bsh), out_shardings=(sh, rep), donate_argnums=0)
    step_checked = jax.jit(checked, in_shardings=(sh, bsh), out_shardings=(sh, (rep, rep)),
                           donate_argnums=0)
    data = DataPipeline(cfg.data, cfg.model, cfg.rng, cfg.train.global_batch)
    batches = [{k: jax.device_put(v, bsh[k]) for k, v in data.batch(s, plan).arrays().items()}
               for s in range(2)]
    init = jax.jit(f._init, out_shardings=sh)

    def timed(step, snapshot: str | None) -> float:
        state = init()
        jax.block_until_ready(state)
        times, pending = [], None
        for s in range(args.steps + 2):
            t0 = time.perf_counter()
            state, out = step(state, batches[s % 2])
            if snapshot == "overlapped":
                # a copy of the new state (the next step donates it), sent to the host while
                # the next step runs; the previous one is collected now
                snap = jax.tree.map(lambda x: x.copy(), state)
                for x in jax.tree.leaves(snap):
                    x.copy_to_host_async()
                if pending is not None:
                    jax.tree.map(np.asarray, pending)
                pending = snap
            elif snapshot == "serial":
                jax.tree.map(np.asarray, state)
            jax.block_until_ready(out)
            if s >= 2:
                times.append(time.perf_counter() - t0)
        if pending is not None:
            jax.tree.map(np.asarray, pending)
        return statistics.median(times)

    n_params = f.n_params
    state_mb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(f.abstract)) / 2**20

    def link() -> float:
        """Seconds to copy one device array of the state's bytes to host memory (median of 3):
        the device-to-host link the snapshot rows are bound by."""
        x = jax.device_put(np.zeros(int(state_mb * 2**20) // 4, np.float32), dev)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            np.asarray(x + 0)  # a fresh array, not a cached host copy
            times.append(time.perf_counter() - t0)
        del x
        return statistics.median(times)

    def cpu_tiles():
        """The checked step compiled with the CPU's checksum tiles (`checksum.CHUNK`): what an
        accelerator paid before `checksum.tile_elements`."""
        keep = checksum.ACCEL_CHUNK
        checksum.ACCEL_CHUNK = checksum.CHUNK
        try:
            # a new function: jit would reuse `checked`'s trace, made with the other tiles
            return jax.jit(lambda s, b: checked(s, b), in_shardings=(sh, bsh), out_shardings=(sh, (rep, rep)),
                           donate_argnums=0).lower(jax.eval_shape(init), batches[0]).compile()
        finally:
            checksum.ACCEL_CHUNK = keep

    rows = {
        "step, plain": timed(step_plain, None),
        "step, elasjax (checksums)": timed(step_checked, None),
    }
    if dev.platform != "cpu":
        rows["step, elasjax (checksums in CPU-sized tiles)"] = timed(cpu_tiles(), None)
    rows.update({
        "snapshot to host, serial": timed(step_plain, "serial"),
        "snapshot to host, overlapped": timed(step_plain, "overlapped"),
        LINK: link(),
    })
    base = rows["step, plain"]
    card = f"{dev.platform} {getattr(dev, 'device_kind', '')}".strip()
    lines = [f"gpu_costs on {card}, jax {jax.__version__}: GPT {n_params / 1e6:.2f}M parameters, "
             f"state {state_mb:.0f} MB, batch {batch} x {seq}, median of {args.steps} steps; "
             f"device->host {state_mb / 1024 / rows[LINK]:.1f} GiB/s", "",
             "| per step | ms | ratio to plain |", "|---|---|---|"]
    for k, v in rows.items():
        lines.append(f"| {k} | {v * 1e3:.1f} | {v / base:.3f} |")
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"gpu_costs_{args.size}.json"), "w") as fh:
        json.dump({"card": card, "jax": jax.__version__, "n_params": n_params,
                   "state_mb": state_mb, "seconds": rows}, fh, indent=1)
    with open(os.path.join(args.out, f"gpu_costs_{args.size}.md"), "w") as fh:
        fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Your own loop, elastic under real process deaths: the same script alone and as a job.

A small MLP classifier with per-sample dropout, AdamW, ZeRO-1 over `data` and hidden units over
`model`, trained by a plain Python loop. Each step is the block of `es.steps`: a process death
inside it is detected, the state rebuilt on the survivors' mesh from live copies and verified,
and the same step redone, with the same global batch and random numbers.

    python examples/own_loop.py                       # one process, 8 fake CPU devices
    elasjax launch examples/own_loop.py --processes 4 --devices-per-process 2 --kill 6:1
    elasjax launch examples/own_loop.py --processes 4 --kill 5:0 --kill 11:2 -- --steps 16
    elasjax launch examples/own_loop.py --processes 4 --kill 3:1 --worker-restarts 1 \
        -- --steps 120 --pace 0.2

`--out FILE` writes the losses, the final state's digest and the recoveries as JSON (from
the lowest live process), so that two runs can be compared.
"""

import argparse
import json
import os
import time

# alone: 8 fake CPU devices; under launch the worker's backend has started already (inert)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import elasjax  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)  # elasjax.runtime.dispatch
jax.config.update("jax_threefry_partitionable", True)  # random bits independent of sharding
N_CLASSES, DIM, HIDDEN, BATCH = 4, 16, 64, 24


def init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (DIM, HIDDEN)) * 0.2, "b1": jnp.zeros((HIDDEN,)),
            "w2": jax.random.normal(k2, (HIDDEN, N_CLASSES)) * 0.2, "b2": jnp.zeros((N_CLASSES,))}


def forward(params, x, keys):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.9, (HIDDEN,)))(keys)  # per sample
    return jnp.where(keep, h / 0.9, 0.0) @ params["w2"] + params["b2"]


def data(step):
    """The global batch of `step`: the same samples whatever the mesh (ids are global)."""
    ids = (step * BATCH + np.arange(BATCH)) % 1000
    rs = np.random.RandomState(ids)  # noqa: NPY002 (a fixed synthetic data set)
    y = ids % N_CLASSES
    x = rs.normal(size=(BATCH, DIM)).astype(np.float32) + y[:, None].astype(np.float32)
    return {"x": x, "y": y.astype(np.int32), "id": ids.astype(np.int32)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=None)
    ap.add_argument("--pace", type=float, default=0.0,
                    help="seconds each step waits after its commit (a stand-in for a bigger "
                    "step) while the job, shrunk by its first failure, waits for a restarted "
                    "process to rejoin (after a join or a second failure: no wait)")
    ap.add_argument("--standby", action="store_true",
                    help="compile the step for every likely failure's mesh before step 0")
    ap.add_argument("--checkpoint", default=None, metavar="DIR",
                    help="Orbax checkpoints every 2 steps in DIR: the last rung, when a slice "
                    "of the state has no live copy")
    args = ap.parse_args()

    tx = optax.adamw(3e-3)
    root = jax.random.key(0)
    axes = {"data": -1, "model": (2, 1)}  # prefer model 2; model 1 when it uses more devices
    mesh, _ = elasjax.plan_mesh(jax.devices(), axes)

    def shardings(m):
        p = {"w1": NamedSharding(m, P(None, "model")), "b1": NamedSharding(m, P("model")),
             "w2": NamedSharding(m, P("model", None)), "b2": NamedSharding(m, P())}
        opt = elasjax.opt_state_shardings(tx, abstract["opt"], abstract["params"], p)
        z = elasjax.zero_shardings(1, p, opt, abstract["params"], abstract["opt"])  # ZeRO-1
        return {"params": z.params, "opt": z.opt, "step": NamedSharding(m, P()),
                "key": NamedSharding(m, P())}

    def fresh():  # the dropout key is state too (a typed key: moved, verified, handed on)
        params = init(root)
        return {"params": params, "opt": tx.init(params), "step": jnp.int32(0),
                "key": jax.random.fold_in(root, 1)}

    abstract = jax.eval_shape(fresh)
    state = jax.jit(fresh, out_shardings=shardings(mesh))()  # each process makes its part
    ckpt = (elasjax.CheckpointConfig(args.checkpoint, every=2, keep=2) if args.checkpoint
            else None)
    es = elasjax.ElasticState(state, shardings, mesh, axes=axes, checkpoint=ckpt)

    def loss_fn(params, b, keys):
        logits = forward(params, b["x"], keys)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])
        return jnp.sum(ce * b["weight"]) / jnp.sum(b["weight"])  # global normalisation

    def train_step(state, b):
        keys = elasjax.sample_keys(state["key"], state["step"], b["id"])
        loss, g = jax.value_and_grad(loss_fn)(state["params"], b, keys)
        upd, opt = tx.update(g, state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], upd), "opt": opt,
               "step": state["step"] + 1, "key": state["key"]}
        return new, loss

    steps = {}  # mesh -> your step compiled for it (no donation: a death may interrupt it)

    def step_for(m):
        if m not in steps:
            steps[m] = jax.jit(train_step, out_shardings=(es.shardings(m), NamedSharding(m, P())))
        return steps[m]

    if args.standby:
        def batch_like(m):  # the padded global batch's shapes and shardings on mesh `m`
            n, sh = -(-BATCH // m.shape["data"]) * m.shape["data"], NamedSharding(m, P("data"))
            return {"x": jax.ShapeDtypeStruct((n, DIM), jnp.float32, sharding=sh),
                    **{k: jax.ShapeDtypeStruct((n,), dt, sharding=sh)
                       for k, dt in (("y", jnp.int32), ("id", jnp.int32), ("weight", jnp.float32))}}

        es.standby(step_for, batch_like, wait=True, progress=False)
        step_for = lambda m: es.executable()  # noqa: E731 (the standby's, for the current mesh)

    losses = {}
    for step in es.steps(args.steps):
        with step:  # a death in here: recovered, and this step runs again
            b = elasjax.pad_batch(data(step.n), es.mesh.shape["data"])  # weight-0 rows pad
            b = elasjax.put_batch(b, NamedSharding(es.mesh, P("data")))
            state, loss = step_for(es.mesh)(es.state, b)
            es.commit(state, step.n)
        if step.failed:
            r = es.recovery
            print(f"step {step.n}: processes {r.failed_processes} died -> mesh {r.to_mesh} via "
                  f"{r.rung}, verified {r.verified}; detect {r.detect_s:.2f}s, recovery "
                  f"{r.total_s:.2f}s (compile {r.compile_s:.2f}s, standby hit {r.standby_hit}, "
                  f"transfer {r.transfer_s:.2f}s, "
                  f"{r.bytes_cross_process} B across processes)", flush=True)
            continue
        losses[step.n] = float(elasjax.host_value(loss))
        if len(es.recoveries) == 1 and not es.joins:  # (a restart has this long to rejoin)
            time.sleep(args.pace)
    es.close()
    digest = es.state_digest()
    print(f"final loss {losses[args.steps - 1]:.6f} on mesh {dict(es.mesh.shape)}; "
          f"state digest {digest}", flush=True)
    if args.out and es.writer:
        joins = [{"step": j.step, "processes": j.processes, "to_mesh": j.to_mesh,
                  "verified": j.verified, "total_s": j.total_s} for j in es.joins]
        rec = [{"step": r.step, "failed_processes": r.failed_processes, "to_mesh": r.to_mesh,
                "rung": r.rung, "verified": r.verified, "detect_s": r.detect_s,
                "total_s": r.total_s, "first_step_s": r.first_step_s, "mttr_s": r.mttr_s,
                "attempts": r.attempts, "failure_simulation": r.failure_simulation,
                "standby_hit": r.standby_hit, "compile_s": r.compile_s}
               for r in es.recoveries]
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "digest": digest, "mesh": dict(es.mesh.shape),
                       "recoveries": rec, "joins": joins,
                       "key_dtype": str(es.state["key"].dtype)}, f)


if __name__ == "__main__":
    main()

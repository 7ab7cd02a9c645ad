"""Mixed precision, a factored optimizer and an awkward state, made elastic with the pieces.

The state holds bf16 parameters (what inference would use), their f32 master copy (what
Adafactor updates; the forward pass runs in bf16), Adafactor's factored statistics (laid out
like the parameter dimensions they keep by `elasjax.opt_state_shardings`, and over `data` as
well: ZeRO-1 as a sharding edit, so the optimizer keeps its meaning), an int64 step counter and a PRNG key that
drives input noise. 8 fake CPU devices in 4 hosts of 2; host 1 (devices 2, 3) fails at step 6.
The run is then repeated without the failure; the script prints the largest relative loss
deviation (the contract: within 1e-5) and checks that the recovered state was bitwise the
committed one (`Recovery.verified`).

    python examples/adafactor_mixed.py
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
jax.config.update("jax_cpu_enable_async_dispatch", False)  # elasjax.runtime.dispatch

jax.config.update("jax_enable_x64", True)  # for the int64 step counter
jax.config.update("jax_threefry_partitionable", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import elasjax  # noqa: E402

DIM, HIDDEN, BATCH, STEPS, FAIL_AT = 24, 48, 24, 14, 6


def data(step):
    ids = (step * BATCH + np.arange(BATCH)) % 512
    x = np.sin(np.outer(ids + 1, np.arange(1, DIM + 1)) * 0.37).astype(np.float32)
    y = np.tanh(x @ np.linspace(-1, 1, DIM).astype(np.float32))[:, None]
    return {"x": x, "y": y.astype(np.float32), "id": ids.astype(np.int32)}


def init():
    k1, k2 = jax.random.split(jax.random.key(0))
    master = {"w1": jax.random.normal(k1, (DIM, HIDDEN), jnp.float32) / DIM**0.5,
              "w2": jax.random.normal(k2, (HIDDEN, 1), jnp.float32) / HIDDEN**0.5}
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=8)
    return tx, {"master": master, "params": jax.tree.map(lambda w: w.astype(jnp.bfloat16), master),
                "opt": tx.init(master), "step": jnp.asarray(0, jnp.int64),
                "key": jax.random.key(42)}


def shardings(mesh, state, tx):
    rep = NamedSharding(mesh, P())
    p = {"w1": NamedSharding(mesh, P(None, "model")), "w2": NamedSharding(mesh, P("model", None))}
    # Adafactor's row and column statistics keep the parameter dimensions they keep
    opt = elasjax.opt_state_shardings(tx, state["opt"], state["master"], p)
    opt = elasjax.zero_shardings(1, p, opt, state["master"], state["opt"]).opt  # ZeRO-1
    return {"master": p, "params": p, "opt": opt, "step": rep, "key": rep}


def train(fail):
    tx, state = init()
    mesh, _ = elasjax.plan_mesh(jax.devices(), {"data": -1, "model": 2})
    es = elasjax.ElasticState(state, lambda m: shardings(m, state, tx), mesh, devices_per_host=2)

    def loss_fn(master, b, noise_key):
        # a bf16 forward pass; the gradient reaches the f32 master weights through the cast
        params = jax.tree.map(lambda w: w.astype(jnp.bfloat16), master)
        keys = elasjax.sample_keys(noise_key, 0, b["id"])  # one key per global sample
        noise = jax.vmap(lambda k: 0.01 * jax.random.normal(k, (DIM,)))(keys)
        h = jax.nn.gelu((b["x"] + noise).astype(jnp.bfloat16) @ params["w1"])
        pred = (h @ params["w2"]).astype(jnp.float32)
        return jnp.sum(((pred - b["y"]) ** 2)[:, 0] * b["weight"]) / jnp.sum(b["weight"])

    def step_fn(st, b):
        loss, g = jax.value_and_grad(loss_fn)(st["master"], b, st["key"])
        upd, opt = tx.update(g, st["opt"], st["master"])
        master = optax.apply_updates(st["master"], upd)
        return {"master": master, "params": jax.tree.map(lambda w: w.astype(jnp.bfloat16), master),
                "opt": opt, "step": st["step"] + 1,
                "key": jax.random.fold_in(st["key"], st["step"])}, loss

    compiled, losses = None, []
    for step in range(STEPS):
        if fail and step == FAIL_AT:
            es.simulate_failure([2, 3])
            r = es.recover()
            print(f"step {step}: devices {r.failed_devices} failed -> mesh {r.to_mesh} via {r.rung}"
                  f", {r.bytes_moved} B in {r.transfers} copies, verified {r.verified} (failure simulated)")
            compiled = None
        if compiled is None:
            compiled = jax.jit(step_fn, out_shardings=(es.shardings(), None))
        batch = elasjax.pad_batch(data(step), es.mesh.shape["data"])
        st, loss = compiled(es.state, jax.device_put(batch, NamedSharding(es.mesh, P("data"))))
        es.commit(st, step)
        losses.append(float(loss))
    kinds = sorted({str(x.dtype) for x in jax.tree.leaves(es.state)})
    return np.array(losses), es, kinds


if __name__ == "__main__":
    faulty, es, kinds = train(fail=True)
    clean, _, _ = train(fail=False)
    dev = np.max(np.abs(faulty - clean) / np.abs(clean))
    print(f"state dtypes {kinds}; step counter {int(es.state['step'])} ({es.state['step'].dtype})")
    print(f"final loss {faulty[-1]:.6f}; max relative loss deviation from the fault-free run: "
          f"{dev:.2e}")
    assert es.recoveries[0].verified and dev <= 1e-5, dev

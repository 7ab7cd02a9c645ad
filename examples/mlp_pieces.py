"""Your own model, loss and loop, made elastic with elasjax's pieces.

A small Flax MLP classifier with dropout, trained with AdamW on synthetic blobs, on 8 fake CPU
devices as data 4 x model 2 (hidden units split over `model`, Adam moments split over `data` as
well: ZeRO-1). Two hosts of 4 devices... no: four hosts of 2 devices each. At step 8 device 3
fails, at step 16 host 2 (devices 4, 5). The script then trains again without failures and
prints the largest relative loss deviation between the two runs (the contract: within 1e-5).

    python examples/mlp_pieces.py
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
jax.config.update("jax_cpu_enable_async_dispatch", False)  # elasjax.runtime.dispatch
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import elasjax  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)  # random bits independent of sharding
N_CLASSES, DIM, HIDDEN, BATCH, STEPS = 4, 16, 64, 24, 24
FAILURES = {8: [3], 16: [4, 5]}  # step -> devices lost before it runs
LEFT = {}


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, keys):
        h = nn.relu(nn.Dense(HIDDEN)(x))
        keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.9, (HIDDEN,)))(keys)  # per sample
        return nn.Dense(N_CLASSES)(jnp.where(keep, h / 0.9, 0.0))


def data(step):
    """The global batch of `step`: the same samples whatever the mesh (ids are global)."""
    ids = (step * BATCH + np.arange(BATCH)) % 1000
    rs = np.random.RandomState(ids)  # noqa: NPY002 (a fixed synthetic data set)
    y = ids % N_CLASSES
    x = rs.normal(size=(BATCH, DIM)).astype(np.float32) + y[:, None].astype(np.float32)
    return {"x": x, "y": y.astype(np.int32), "id": ids.astype(np.int32)}


def shardings(mesh, state, tx):
    """The layout on any (data, model) mesh: hidden units over `model`, Adam moments like their
    parameters and over `data` too, everything else replicated."""
    rep = NamedSharding(mesh, P())
    kernel = {"Dense_0": {"kernel": P(None, "model"), "bias": P("model")},
              "Dense_1": {"kernel": P("model", None), "bias": P()}}
    params = jax.tree.map(lambda s: NamedSharding(mesh, s), {"params": kernel})
    # the moments get their parameters' shardings, the step count is replicated
    opt = elasjax.opt_state_shardings(tx, state["opt"], state["params"], params)
    z = elasjax.zero_shardings(1, params, opt, state["params"], state["opt"])  # ZeRO-1
    LEFT[tuple(mesh.shape.items())] = z.left  # arrays ZeRO-1 could not split here
    return {"params": z.params, "opt": z.opt, "step": rep}


def train(failures):
    model, tx = MLP(), optax.adamw(3e-3)
    root = jax.random.key(0)
    params = model.init(root, jnp.zeros((1, DIM)), jax.random.split(root, 1))
    state = {"params": params, "opt": tx.init(params), "step": jnp.int32(0)}
    axes = {"data": -1, "model": (2, 1)}  # prefer model 2; model 1 when it uses more devices
    mesh, _ = elasjax.plan_mesh(jax.devices(), axes)
    es = elasjax.ElasticState(state, lambda m: shardings(m, state, tx), mesh, axes=axes,
                              devices_per_host=2)

    def loss_fn(params, b, keys):
        logits = model.apply(params, b["x"], keys)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])
        return jnp.sum(ce * b["weight"]) / jnp.sum(b["weight"])  # global normalisation

    def step_fn(state, b):
        keys = elasjax.sample_keys(root, state["step"], b["id"])
        loss, g = jax.value_and_grad(loss_fn)(state["params"], b, keys)
        upd, opt = tx.update(g, state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], upd), "opt": opt,
               "step": state["step"] + 1}
        return new, loss

    def batch_like(mesh):  # the padded global batch's shapes and shardings on `mesh`
        n = -(-BATCH // mesh.shape["data"]) * mesh.shape["data"]
        sh = NamedSharding(mesh, P("data"))
        return {"x": jax.ShapeDtypeStruct((n, DIM), jnp.float32, sharding=sh),
                **{k: jax.ShapeDtypeStruct((n,), dt, sharding=sh)
                   for k, dt in (("y", jnp.int32), ("id", jnp.int32), ("weight", jnp.float32))}}

    # the step compiled for this mesh and, in the background, for every single-device and
    # single-host failure's mesh (wait: all of them before step 0)
    es.standby(lambda m: jax.jit(step_fn, out_shardings=(es.shardings(m), None)), batch_like,
               wait=True)
    losses = []
    for step in range(STEPS):
        if step in failures:
            es.simulate_failure(failures[step])
            r = es.recover()
            print(f"step {step}: devices {r.failed_devices} failed -> mesh {r.to_mesh} "
                  f"(spares {r.spares}) via {r.rung}, {r.bytes_moved} B in {r.transfers} copies, "
                  f"verified {r.verified}; standby hit {r.standby_hit}, "
                  f"recovery {r.total_s:.2f}s (compile/wait {r.compile_s:.2f}s; failure simulated)")
        batch = elasjax.pad_batch(data(step), es.mesh.shape["data"])  # weight-0 rows pad
        batch = jax.device_put(batch, NamedSharding(es.mesh, P("data")))
        state, loss = es.executable()(es.state, batch)
        es.commit(state, step)
        losses.append(float(loss))
    es.close()
    return np.array(losses), es


if __name__ == "__main__":
    faulty, es = train(FAILURES)
    clean, _ = train({})
    dev = np.max(np.abs(faulty - clean) / np.abs(clean))
    left = LEFT[tuple(es.mesh.shape.items())]
    print(f"ZeRO-1 on the final mesh: {len(left)} optimizer arrays stay replicated over 'data' "
          f"(no free dimension divides {es.mesh.shape['data']})" + (f", e.g. {left[0]}" if left else ""))
    print(f"final loss {faulty[-1]:.5f} on mesh {dict(es.mesh.shape)}; "
          f"max relative loss deviation from the fault-free run: {dev:.2e}")
    assert dev <= 1e-5, dev

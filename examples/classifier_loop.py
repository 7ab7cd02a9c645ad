"""Your own model on elasjax's loop: a `ModelSpec` registered by name, trained with Adafactor.

The loop (`elasjax.run`) plans the mesh by cost model, keeps snapshots, recovers, verifies and
keeps the fault-free computation; the model is data: init, logical axis names (hidden units
split over `tensor` via the logical name "mlp"), a loss over a weighted batch (summed: the loop
divides by the step's real samples), and its examples. 8 fake CPU devices in 4 hosts of 2;
device 3 fails at step 6, host 0 (devices 0, 1) at step 12. The run is repeated without the
failures and the largest relative loss deviation is printed (the contract: within 1e-5).

    python examples/classifier_loop.py
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
jax.config.update("jax_cpu_enable_async_dispatch", False)  # elasjax.runtime.dispatch
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import elasjax  # noqa: E402

DIM, HIDDEN, CLASSES, N = 32, 64, 8, 4096


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x, keys, deterministic):
        h = nn.gelu(nn.Dense(HIDDEN)(x))
        if not deterministic:  # dropout drawn from each sample's own key
            keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.9, (HIDDEN,)))(keys)
            h = jnp.where(keep, h / 0.9, 0.0)
        return nn.Dense(CLASSES)(h)


def data(_data_config):
    """Gaussian blobs, one per class (train and held-out splits)."""
    rs = np.random.RandomState(0)  # noqa: NPY002
    centers = rs.normal(size=(CLASSES, DIM)).astype(np.float32)
    y = rs.randint(0, CLASSES, N).astype(np.int32)
    x = centers[y] + 1.5 * rs.normal(size=(N, DIM)).astype(np.float32)
    return elasjax.ArraySource(train={"x": x[:-512], "y": y[:-512]},
                               val={"x": x[-512:], "y": y[-512:]})


def loss(params, batch, keys, weights, deterministic, layer_transform=None):
    logits = Classifier().apply({"params": params}, batch["x"], keys, deterministic)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return jnp.sum(ce * weights)  # summed over real samples (weight 0 = padding)


elasjax.register_model(elasjax.ModelSpec(
    name="blob-classifier",
    init_params=lambda key: Classifier().init(
        {"params": key}, jnp.zeros((1, DIM)), jax.random.split(key, 1), True)["params"],
    logical_specs=lambda: {"Dense_0": {"kernel": P(None, "mlp"), "bias": P("mlp")},
                           "Dense_1": {"kernel": P("mlp", None), "bias": P(None)}},
    loss=loss,
    example_shapes={"x": jax.ShapeDtypeStruct((DIM,), jnp.float32),
                    "y": jax.ShapeDtypeStruct((), jnp.int32)},
    data=data,
    tensor_degrees=(1, 2),  # HIDDEN splits over 2
))

SETTINGS = [
    "model.type=blob-classifier", "train.steps=18", "train.global_batch=48",
    "train.microbatches=2", "train.eval_every=6", "parallel.devices=8",
    "parallel.devices_per_host=2", "parallel.data=4", "parallel.tensor=2",
    "hardware.name=cpu-fake", "hardware.flops=2.0e9",  # 8 fake devices on shared cores
]
FAULTS = "faults=[{at_step: 6, devices: [3]}, {at_step: 12, hosts: [0]}]"


def run(faults):
    cfg = elasjax.load_config(None, [*SETTINGS, faults])
    return elasjax.run(cfg, optimizer=optax.adafactor(3e-2, min_dim_size_to_factor=8))


if __name__ == "__main__":
    faulty = run(FAULTS)
    for r in faulty.recoveries:
        print(f"step {r.step}: devices {r.failed_devices} failed -> {r.from_plan} => {r.to_plan} "
              f"via {r.rung}, verified {r.verified}, MTTR {r.mttr_s:.2f}s "
              f"(compile {r.compile_s:.2f}s; failure simulated in one process)")
    clean = run("faults=[]")
    dev = max(abs(faulty.losses[s] - clean.losses[s]) / clean.losses[s] for s in clean.losses)
    print(f"final loss {faulty.final_loss:.5f} (from {faulty.losses[0]:.5f}) on "
          f"{faulty.final_plan.name}; held-out {faulty.eval_losses[max(faulty.eval_losses)]:.5f}")
    print(f"max relative loss deviation from the fault-free run: {dev:.2e}")
    assert all(r.verified for r in faulty.recoveries) and dev <= 1e-5, dev

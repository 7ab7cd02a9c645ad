"""One collective per operand on XLA:CPU's gloo collectives: plain JAX, no elasjax.

    python experiments/repro_gloo_per_operand.py                  # 4 processes x 2 devices
    python experiments/repro_gloo_per_operand.py --processes 2 --operands 1,10,30

A `jax.distributed` job of `--processes` processes, `--devices` CPU devices each, gloo
collectives. One jitted program sums an array of `--elements` float32 per device over every
device, the array cut into L equal slices each summed on its own (`jnp.sum` over the device
axis), for each L of `--operands`: XLA combines the L sums into one all-reduce of L operands,
and XLA:CPU runs each operand as a gloo all-reduce of its own. The same bytes then cost about
L collectives' latency: each crosses processes, a few wake-ups of other processes' threads per
round, which on a loaded host is milliseconds each.

Printed (process 0): the median and minimum of 20 timed runs per L, and the ratio to L=1.
Exit code 0 when every process ended cleanly. About 20 s on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys


def worker(pid: int, n: int, port: int, devices: int, elements: int, operands: list[int]) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", devices)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid)
    import time

    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("d",))
    shape = (len(jax.devices()), elements)
    x = jax.make_array_from_callback(shape, NamedSharding(mesh, P("d")),
                                     lambda idx: np.ones((1, elements), np.float32))
    base = None
    for L in operands:
        w = elements // L

        @jax.jit
        def step(x):
            sums = [jnp.sum(x[:, i * w:(i + 1) * w], axis=0) for i in range(L)]  # L operands
            return x * 0.5 + jnp.concatenate(sums).sum() * 1e-9

        for _ in range(3):
            x = step(x).block_until_ready()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            x = step(x).block_until_ready()
            times.append(time.perf_counter() - t0)
        if pid == 0:
            med = float(np.median(times)) * 1e3
            base = base or med
            print(f"L={L:3d} operands: median {med:7.1f} ms, min {min(times) * 1e3:7.1f} ms, "
                  f"{med / base:5.1f}x L={operands[0]}", flush=True)
    jax.distributed.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    ap.add_argument("--elements", type=int, default=1 << 18, help="float32 per device")
    ap.add_argument("--operands", default="1,30", help="comma-separated L values")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    operands = [int(v) for v in a.operands.split(",")]
    if a.worker is not None:
        worker(a.worker, a.processes, a.port, a.devices, a.elements, operands)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"{a.processes} processes x {a.devices} CPU devices, gloo; an all-reduce of "
          f"{a.elements} float32 per device cut into L operands")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), "--port", str(port),
                               "--processes", str(a.processes), "--devices", str(a.devices),
                               "--elements", str(a.elements), "--operands", a.operands],
                              env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
             for i in range(a.processes)]
    codes = [p.wait() for p in procs]
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())

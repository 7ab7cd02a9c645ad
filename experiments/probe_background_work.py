"""How much a background thread of a training process slows its steps: the step time of a small
sharded MLP (8 fake CPU devices, data 4 x tensor 2) alone, then beside a thread at nice 10 (as
the standby's and the shared builds' compile threads run: `compilation.standby`) doing one kind
of work, in one process.

    python experiments/probe_background_work.py [--work compile|python] [--switch S]

`compile`: a stream of new programs lowered and compiled (Python tracing and XLA);
`python`: pure Python (holds the GIL, no XLA). `--switch S` sets `sys.setswitchinterval(S)`.
Prints the median and max step time, alone and beside the work; run it beside busy loops to
see a loaded host. Results: experiments/RESULTS.md, "A background thread's cost to a step"."""

import argparse
import os
import sys
import threading
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

D = 512


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", choices=("compile", "python"), default="compile")
    ap.add_argument("--switch", type=float, default=None)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    if args.switch:
        sys.setswitchinterval(args.switch)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"))
    w = jax.device_put(jnp.ones((D, D)) * 0.01, NamedSharding(mesh, P(None, "tensor")))
    x = jax.device_put(jnp.ones((256, D)), NamedSharding(mesh, P("data", None)))

    @jax.jit
    def step(w, x):
        def loss(w):
            h = x
            for _ in range(8):
                h = jnp.tanh(h @ w)
            return (h ** 2).mean()
        return w - 0.1 * jax.grad(loss)(w)

    for _ in range(3):
        w = step(w, x).block_until_ready()

    def steps(w):
        ts = []
        for _ in range(args.steps):
            t = time.perf_counter()
            w = step(w, x).block_until_ready()
            ts.append(time.perf_counter() - t)
        return w, float(np.median(ts)) * 1e3, max(ts) * 1e3

    stop, done = threading.Event(), [0]

    def work() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        i = 0
        while not stop.is_set():
            i += 1
            if args.work == "python":
                sum(k * k for k in range(100_000))
            else:
                @jax.jit
                def f(a, i=i):
                    for k in range(40):
                        a = jnp.sin(a @ a.T + i + k) @ a
                    return a
                f.lower(jnp.ones((64 + i % 50, 64))).compile()
            done[0] += 1

    w, med0, max0 = steps(w)
    th = threading.Thread(target=work, daemon=True)
    th.start()
    time.sleep(1.0)
    w, med1, max1 = steps(w)
    stop.set()
    th.join()
    print(f"work={args.work} switch={sys.getswitchinterval()} load={os.getloadavg()[0]:.1f}: "
          f"step alone median {med0:.1f} ms (max {max0:.1f}); beside the work median "
          f"{med1:.1f} ms (max {max1:.1f}), x{med1 / med0:.2f}; {done[0]} units of work")


if __name__ == "__main__":
    main()

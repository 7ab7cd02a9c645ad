"""Does a survivor's gloo collective outlive the shutdown of its sockets? Plain JAX.

    python experiments/repro_gloo_queued_send.py                     # 4 processes x 2 devices
    python experiments/repro_gloo_queued_send.py --elements 2048,262144 --trials 4 --compute 8

A `jax.distributed` job of `--processes` processes, `--devices` CPU devices each, gloo
collectives, a peer's death not fatal (`jax_enable_recoverability`). Every process runs one
jitted program in a loop: `--compute` matmul layers, then a sum of E float32 per device over
every device (one all-reduce, one operand). At a random point the last process SIGKILLs itself.
Each survivor's watcher thread sees the death in /proc (a fast detector, as elasjax's exit
watch is) and shuts down every TCP connection of its process except the coordination
service's (`elasjax.runtime.collectives.abort_collectives`, the only elasjax code used).
Printed, per survivor: how long after that shutdown its pending program failed; a survivor that
waited about `--collective-timeout` had a device thread blocked past the shutdown.

Why it was written: under `elasjax launch`, with ZeRO-0's gradient sum packed into one
all-reduce, a survivor's device thread waited out the 8 s timeout in
`gloo::tcp::UnboundBuffer::waitSend` after its sockets were shut down, in 4 of 8 demo launches
(experiments/RESULTS.md, "One collective per operand under launch"). A reading of gloo's
`transport/tcp/pair.cc` (as stored) suggests a way: a send that cannot be written at once
(EAGAIN, or EPIPE on a socket already shut down, which returns without an error in async mode)
waits in the pair's queue, and a pair's failure signals its bound buffers and pending unbound
operations but not an unbound buffer's queued send. This probe, the plain form of that step,
did not show it: every survivor failed within 0.02-0.06 s (experiments/RESULTS.md, "A survivor's
gloo send after the socket shutdown: plain JAX does not wait"). The coordination service runs in
process 0 here (elasjax runs it in a process of its own); a survivor that dies with a gRPC
"Socket closed" is that, not gloo, and is printed as "no report".
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def worker(pid: int, n: int, port: int, devices: int, elements: int, victim_file: str,
           timeout: int, seed: int, compute: int) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_cpu_collective_timeout_seconds={timeout}"
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", devices)
    jax.config.update("jax_enable_recoverability", True)  # a peer's death is not fatal
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid,
                               heartbeat_timeout_seconds=300)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from elasjax.runtime.collectives import abort_collectives

    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = jax.make_array_from_callback((len(jax.devices()), elements), NamedSharding(mesh, P("d")),
                                     lambda idx: np.ones((1, elements), np.float32))

    w = jnp.full((256, 256), 1e-3, jnp.float32)

    @jax.jit
    def step(x):
        y = x
        for _ in range(compute):  # device work before the collective, as a backward pass
            y = jnp.tanh((y.reshape(y.shape[0], -1, 256) @ w).reshape(y.shape))
        return x * 0.5 + jnp.sum(y, axis=0, keepdims=True) * 1e-3  # one all-reduce

    for _ in range(3):
        x = step(x).block_until_ready()
    victim = n - 1
    if pid == victim:
        with open(victim_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(victim_file + ".tmp", victim_file)
    while not os.path.exists(victim_file):
        time.sleep(0.01)
    with open(victim_file) as f:
        victim_pid = int(f.read())
    rng = random.Random(seed)
    kill_at = rng.randrange(5, 15)
    if pid == victim:
        for _ in range(kill_at):
            x = step(x)
        time.sleep(rng.random() * 0.02)  # somewhere in a run
        os.kill(os.getpid(), signal.SIGKILL)

    shut = {}

    def watch():
        while _state(victim_pid) not in ("Z", "X"):
            time.sleep(0.001)
        shut["t"] = time.perf_counter()
        shut["n"] = abort_collectives([port])

    threading.Thread(target=watch, daemon=True).start()
    try:
        while True:
            x = step(x).block_until_ready()
    except Exception as err:  # noqa: BLE001 (the survivor's failed collective)
        t = time.perf_counter()
        while "n" not in shut:
            time.sleep(0.001)
        msg = str(err).splitlines()[0][:90]
        print(f"  process {pid}: failed {t - shut['t']:6.3f} s after its {shut['n']} sockets' "
              f"shutdown ({msg})", flush=True)
    os._exit(0)


def run(a, elements: int, trial: int, tmp: str) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    victim_file = os.path.join(tmp, f"victim_{elements}_{trial}")
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--worker", str(i), "--port", str(port), "--processes",
         str(a.processes), "--devices", str(a.devices), "--elements", str(elements),
         "--victim-file", victim_file, "--collective-timeout", str(a.collective_timeout),
         "--seed", str(trial), "--compute", str(a.compute)],
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"), stdout=subprocess.PIPE, text=True,
        stderr=subprocess.PIPE) for i in range(a.processes)]
    out = []
    for i, p in enumerate(procs):
        try:
            o, e = p.communicate(timeout=a.collective_timeout * 4 + 120)
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
        lines = [ln for ln in o.splitlines() if ln.strip() and "[Gloo]" not in ln]
        if not lines and i != a.processes - 1:  # a survivor that reported nothing
            last = [ln for ln in e.splitlines() if ln.strip() and "[Gloo]" not in ln
                    and not ln.lstrip().startswith("@")][-2:]
            lines = [f"  process {i}: no report, exit code {p.returncode}: " + " | ".join(last)]
        out += lines
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    ap.add_argument("--elements", default="2048,262144",
                    help="comma-separated float32 per device, one all-reduce each")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--collective-timeout", type=int, default=8)
    ap.add_argument("--compute", type=int, default=0,
                    help="matmul layers before the all-reduce in each program")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--victim-file", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        worker(a.worker, a.processes, a.port, a.devices, int(a.elements), a.victim_file,
               a.collective_timeout, a.seed, a.compute)
        return 0
    import tempfile

    print(f"{a.processes} processes x {a.devices} CPU devices, gloo, collective timeout "
          f"{a.collective_timeout} s; the last process SIGKILLed in a loop of all-reduces")
    with tempfile.TemporaryDirectory() as tmp:
        for elements in (int(v) for v in a.elements.split(",")):
            for trial in range(a.trials):
                print(f"{elements} float32 per device ({elements * 4} bytes), trial {trial}:",
                      flush=True)
                for line in run(a, elements, trial, tmp):
                    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

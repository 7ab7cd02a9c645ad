"""A stale gloo message in XLA:CPU's collectives: plain JAX, two processes, no elasjax.

    python experiments/repro_gloo_stale_message.py                # SIGABRT in a healthy process
    python experiments/repro_gloo_stale_message.py --same-size    # no error, a wrong sum
    python experiments/repro_gloo_stale_message.py --renew        # a fresh client: correct sums

Two processes of one `jax.distributed` job, one CPU device each, gloo collectives. Both run
program A, an all-reduce of 1024 float32 over their two devices; on process 1 a host callback
raises before A's all-reduce (any error that ends a program before one of its collectives
does: in an elastic trainer, a peer's death seen on another communicator). Process 0 has
posted its 4096 bytes to process 1 and waits for the reply. Both then run program B, an
all-reduce of one float32 over the same two devices.

What XLA:CPU does (read in `xla/backends/cpu/collectives/gloo_communicator.cc`,
`cpu_cliques.cc`; gloo `transport/tcp/pair.cc`): every all-reduce on a communicator uses the
same gloo slot (tag 0), the communicator of a device set lives as long as the client and is
kept after an error, and gloo matches a receive with the oldest message of its slot. So B's
receive on process 1 is handed A's 4096 bytes from process 0; gloo's size check throws on its
own network thread, which has no handler: `std::terminate`, SIGABRT, in a process that had
nothing wrong with it. With `--same-size` (B as large as A) the check passes and B's sum on
process 1 silently adds process 0's *old* values.

`--renew`: before B, both processes wait until every program they dispatched has finished
(process 0's A ends at the collective timeout), then replace the CPU client by a new one (its
rendezvous keys deleted first): B runs on fresh communicators and both sums are right. This is
what elasjax does after any interrupted block (elasjax/runtime/collectives.py).

Printed: each process's exit status, its last lines, and the verdict. Exit code 0 when the
outcome is the one the mode predicts (abort / wrong sum / right sums), else 1. jax >= 0.10.2
on Linux; about 15 s.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

A_SIZE = 1024  # float32: 4096 bytes
TIMEOUT_S = 4  # --xla_cpu_collective_timeout_seconds


def worker(pid: int, port: int, same_size: bool, renew: bool) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_cpu_collective_timeout_seconds={TIMEOUT_S}"
    import jax
    import numpy as np
    from jax.experimental import io_callback
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 1)
    jax.config.update("jax_enable_recoverability", True)  # process 1's abort spares process 0
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               heartbeat_timeout_seconds=60)
    from jax._src import distributed

    kv = distributed.global_state.client

    def say(msg: str) -> None:
        print(f"process {pid}: {msg}", flush=True)

    def fail_on_process_1(x):
        if pid == 1:
            raise RuntimeError("process 1's program A fails before its all-reduce")
        return x

    def sums(size: int, value: float, with_callback: bool):
        devices = sorted(jax.devices(), key=lambda d: d.process_index)
        mesh = Mesh(np.array(devices), ("i",))
        sh = NamedSharding(mesh, P("i"))

        def body(x):
            if with_callback:
                x = io_callback(fail_on_process_1, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
            return jax.lax.psum(x, "i")

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
        local = np.full((1, size), value, np.float32)
        x = jax.make_array_from_single_device_arrays(
            (2, size), sh, [jax.device_put(local, jax.local_devices()[0])])
        return fn(x)

    # warm up: both processes run both programs once, so the communicator exists
    a = sums(A_SIZE, 1.0, with_callback=False)
    b = sums(A_SIZE if same_size else 1, 1.0, with_callback=False)
    jax.block_until_ready((a, b))
    kv.wait_at_barrier("warm", 30_000)
    say("communicator warmed up; program A (process 0 posts 100.0 x 1024, process 1 fails first)")
    try:  # dispatch may raise at once (the callback runs before the call returns)
        a = sums(A_SIZE, 100.0 if pid == 0 else 7.0, with_callback=True)
        if pid == 1:
            a.block_until_ready()
    except Exception as e:  # noqa: BLE001
        a = None
        say(f"program A failed: {str(e).splitlines()[0][:120]}")
    if renew:
        try:  # every program dispatched has finished (process 0's A: at the collective timeout)
            if a is not None:
                a.block_until_ready()
        except Exception as e:  # noqa: BLE001
            say(f"drained program A: {str(e).splitlines()[0][:100]}")
        kv.wait_at_barrier("drained", 60_000)
        if pid == 0:  # a new client rendezvouses again: its keys go first
            for d in ("cpu:gloo", "cpu:global_topology", "cpu:local_topology"):
                kv.key_value_delete(d)
            kv.key_value_set("renew/ready", "1")
        else:
            kv.blocking_key_value_get("renew/ready", 30_000)
        from jax.extend import backend

        backend.clear_backends()
        say("a new CPU client (fresh communicators)")
    else:
        time.sleep(0.5)  # process 0's A message has arrived at process 1
    size = A_SIZE if same_size else 1
    b = sums(size, 1.0 if pid == 0 else 2.0, with_callback=False)
    got = np.asarray(b.addressable_shards[0].data)
    say(f"program B: sum {got.ravel()[0]:g} (expected 3; x{size} values equal: "
        f"{bool(np.all(got == got.ravel()[0]))})")
    kv.wait_at_barrier("end", 60_000)
    if pid == 0:  # the coordination service's host leaves last (a peer's shutdown needs it)
        time.sleep(2.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--same-size", action="store_true", help="program B as large as A")
    ap.add_argument("--renew", action="store_true", help="a new CPU client before program B")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.port, args.same_size, args.renew)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import jax

    mode = "renew" if args.renew else "same-size" if args.same_size else "default"
    print(f"jax {jax.__version__}; mode: {mode}", flush=True)
    flags = [f for f in ("--same-size", "--renew") if getattr(args, f[2:].replace("-", "_"))]
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(p), "--port", str(port),
                               *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for p in (0, 1)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outs.append(out)
    codes = [p.returncode for p in procs]
    for pid, (rc, out) in enumerate(zip(codes, outs)):
        how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
        keep = [ln for ln in out.splitlines() if ln.startswith(f"process {pid}:")
                or "Received data size" in ln or "terminate" in ln]
        print(f"--- process {pid}: {how}")
        print("\n".join(keep[-8:]))
    b_lines = ["".join(ln for ln in out.splitlines() if "program B: sum" in ln) for out in outs]
    aborted = codes[1] == -signal.SIGABRT and "Received data size" in outs[1]
    right = all("sum 3 " in ln for ln in b_lines)
    wrong = any(ln and "sum 3 " not in ln for ln in b_lines)
    if mode == "default":
        verdict, ok = ("process 1 (healthy) aborted in gloo on a stale message" if aborted
                       else "no abort this time"), aborted
    elif mode == "same-size":
        verdict, ok = ("a wrong sum, no error" if wrong else "no wrong sum this time"), wrong
    else:
        verdict, ok = ("both sums right on a new client" if right and codes == [0, 0]
                       else "a fresh client did not help"), right and codes == [0, 0]
    print(f"verdict: {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

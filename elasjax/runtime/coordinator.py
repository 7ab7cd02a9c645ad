"""The coordination process of an `elasjax launch` job: JAX's coordination service (the
key-value store every membership decision goes through, and the task registry) in a process that
holds no device and no training state. Any training process, the first one included, can then
die and be survived like any other; only this process's own death ends the job (`launch`:
outcome `coordinator_lost`, exit 3, or a restart from the newest checkpoint under
`--max-restarts`).

On a cluster, run it on a stable node and point every worker at it:

    python -m elasjax.runtime.coordinator --port 7777 --processes 4

`elasjax launch` starts one per attempt on this machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

READY = "elasjax coordinator: serving"


def serve(port: int, processes: int, heartbeat_timeout_s: int) -> None:
    """Run the service until SIGTERM or SIGINT. Announces itself on stdout with `READY`."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # it needs no accelerator, and takes none
    from ..core import jaxcompat

    service = jaxcompat.start_coordination_service(f"[::]:{port}", processes, heartbeat_timeout_s)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"{READY} {processes} processes on port {port} (pid {os.getpid()})", flush=True)
    stop.wait()
    del service


def start_local(port: int, processes: int, heartbeat_timeout_s: int, log: Path,
                env: dict | None = None, wait_s: float = 60.0) -> subprocess.Popen:
    """Start a coordination process on this machine (its own session: the launcher's signals
    and a worker's death do not reach it) and wait until it serves; its output goes to `log`."""
    cmd = [sys.executable, "-m", "elasjax.runtime.coordinator", "--port", str(port),
           "--processes", str(processes), "--heartbeat-timeout", str(heartbeat_timeout_s)]
    with log.open("wb") as fh:
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
    t_end = time.time() + wait_s
    while time.time() < t_end:
        if p.poll() is not None:
            raise RuntimeError(f"the coordination process ended at start ({p.returncode}): "
                               + log.read_text(errors="replace")[-400:])
        if READY in log.read_text(errors="replace"):
            return p
        time.sleep(0.05)
    p.kill()
    raise RuntimeError(f"the coordination process did not serve within {wait_s:g}s: "
                       + log.read_text(errors="replace")[-400:])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m elasjax.runtime.coordinator",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--processes", type=int, required=True, help="training processes of the job")
    ap.add_argument("--heartbeat-timeout", type=int, default=30,
                    help="the service's own heartbeat timeout, seconds (not the failure detector)")
    args = ap.parse_args(argv)
    if args.processes < 1:
        ap.error(f"--processes {args.processes}; allowed values: an integer >= 1")
    serve(args.port, args.processes, args.heartbeat_timeout)


if __name__ == "__main__":
    main()

"""The pieces' standby start-up time on the example model (`examples/mlp_pieces.py`).

    python experiments/bench_pieces_standby.py [--repeats 1]

Runs the example's fault-free training (`train({})`) and times its `es.standby(make_step,
batch_like, wait=True)` call: the step and checksum function built for the current mesh (data 4
x model 2 over 8 fake CPU devices, hosts of 2) and for the mesh of every single-device and
single-host failure, before step 0. Prints the seconds, how many meshes, and (where this
version of elasjax reports them) how many were compiled and how many rebound from a compile for
the same mesh shape. The script runs against whichever elasjax is importable, so the same
command measures any commit. Wall-clock on shared cores: compare runs of one sitting.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=1, help="fresh ElasticStates to time")
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats = {args.repeats}; allowed values: an int >= 1")
    spec = importlib.util.spec_from_file_location("mlp_pieces", ROOT / "examples" / "mlp_pieces.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)  # sets 8 fake devices before JAX starts
    import elasjax

    seen = []
    inner = elasjax.ElasticState.standby

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        out = inner(self, *a, **kw)
        s = time.perf_counter() - t0
        sb = self._standby
        seen.append({
            "standby_s": round(s, 3),
            "meshes": 1 + len(self.likely_meshes()),
            "shapes": len({tuple(m.shape.items()) for m in [self.mesh, *self.likely_meshes()]}),
            "compiled": getattr(sb, "compiled", None),
            "rebound": getattr(sb, "rebound", None),
            "mesh": dict(self.mesh.shape),
        })
        return out

    elasjax.ElasticState.standby = timed
    for _ in range(args.repeats):
        ex.train({})
    for r in seen:
        print(json.dumps(r))
    times = ", ".join(f"{r['standby_s']:.2f}" for r in seen)
    print(f"standby start-up: {times} s ({seen[0]['meshes']} meshes, {seen[0]['shapes']} shapes)")


if __name__ == "__main__":
    main()

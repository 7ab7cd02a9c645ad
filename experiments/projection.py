"""SIMULATED: the fault-free cost of elasjax's protection on accelerator hosts, 1B-70B parameters.

    python experiments/projection.py [--tokens-per-device 32768] [--mfu 0.4] [--out results/projection]

A cost model, not a measurement. Per device and per step, for a GPT-like model of N parameters
trained data-parallel over D devices (hosts of 8) with mixed precision (bf16 parameters and
gradients, fp32 master copy and Adam moments: 16 bytes per parameter of state):

  compute      6 N t / (peak x MFU), t tokens per device per step
  collectives  ZeRO-1: reduce-scatter of bf16 gradients + all-gather of bf16 parameters, ring:
               2 x 2N (D-1)/D bytes; ZeRO-3 adds an all-gather of the parameters for the
               backward pass: 3 x 2N (D-1)/D. Over the NIC where D spans hosts (this model
               puts every ring hop on the NIC: a bound, not a topology)
  snapshot     a copy of each device's unique state every step: ZeRO-1 12 N / D bytes (master +
               moments), ZeRO-3 16 N / D; to a buddy device on another host over the NIC, or,
               for a job of one host (the default there), to host memory over PCIe
  checksums    the state read once from HBM per step (each element hashed once over the mesh):
               (16 N / D + 2 N / D) bytes / HBM bandwidth, x CHECKSUM_PASSES (measured: on one
               H200 the checksums hashed ~1.34 TB/s of state, 1/3.6 of its 4.8 TB/s HBM;
               experiments/RESULTS.md, "Checksums on a GPU")
  ZeRO codec   0: the fresh layout's storage is the parameter block as gathered
               (experiments/bench_scale.py measures the step against plain JAX ZeRO-1)

The smallest number of hosts on which the state fits in half of HBM (ZeRO-1: 4N full bf16
parameters and gradients + 12N/D; ZeRO-3: 16N/D; the rest for activations) is used, ZeRO-1
where it fits, else ZeRO-3. Printed: step time, the share of the NIC's bytes per step that the
snapshot takes beside the collectives, and the step ratio with the snapshot and checksums not
overlapped (an upper bound) and overlapped with the step's compute (what the trainer does on an
accelerator: the copies are asynchronous).

Stated hardware (an H100-SXM-class card; none of it is measured here): 989 TFLOP/s bf16 dense,
3.35 TB/s HBM, 80 GB, one 400 Gb/s NIC per GPU.
"""

from __future__ import annotations

import argparse
import json
import os

PEAK = 989e12  # bf16 dense FLOP/s
HBM_BW = 3.35e12  # bytes/s
CHECKSUM_PASSES = 3.6  # the checksums' cost in HBM reads of the state, measured (docstring)
HBM = 80e9  # bytes
NIC = 50e9  # bytes/s (400 Gb/s) per GPU
PCIE = 50e9  # bytes/s device -> host memory (PCIe Gen5 x16, one direction)
PER_HOST = 8

MODELS = {"1B": 1.0e9, "7B": 6.7e9, "13B": 13.0e9, "70B": 70.0e9}


def project(n: float, tokens: int, mfu: float) -> dict:
    for hosts in range(1, 1025):
        d = hosts * PER_HOST
        if 4 * n + 12 * n / d <= 0.5 * HBM:
            zero = 1
            break
        if 16 * n / d <= 0.5 * HBM:
            zero = 3
            break
    compute = 6 * n * tokens / (PEAK * mfu)
    ring = (d - 1) / d
    coll_bytes = (2 if zero == 1 else 3) * 2 * n * ring
    snap_bytes = (12 if zero == 1 else 16) * n / d
    coll = coll_bytes / NIC if hosts > 1 else coll_bytes / (450e9)  # NVLink inside one host
    # on one host the default snapshot is a host-memory copy over PCIe; with two hosts or more a
    # buddy device's copy on another host, over the NIC
    snap = snap_bytes / (NIC if hosts > 1 else PCIE)
    ck = CHECKSUM_PASSES * (16 * n / d + 2 * n / d) / HBM_BW
    base = max(compute, coll)  # collectives overlapped with compute where they can be
    serial = (base + snap + ck) / base
    overlapped = max(compute, coll + snap) / base + ck / base
    return {"params": n, "hosts": hosts, "devices": d, "zero": zero, "compute_s": compute,
            "collective_s": coll, "snapshot_s": snap, "checksum_s": ck,
            "snapshot_to": "buddy on another host (NIC)" if hosts > 1 else "host memory (PCIe)",
            "nic_share": snap_bytes / (snap_bytes + coll_bytes) if hosts > 1 else None,
            "ratio_serial": serial, "ratio_overlapped": overlapped}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens-per-device", type=int, default=32768)
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--out", default="results/projection")
    args = ap.parse_args(argv)
    rows = {k: project(v, args.tokens_per_device, args.mfu) for k, v in MODELS.items()}
    lines = [
        f"SIMULATED (cost model, stated H100-class hardware; {args.tokens_per_device} tokens per "
        f"device per step, MFU {args.mfu})",
        "",
        "| model | hosts x 8 | ZeRO | compute s | collectives s | snapshot to | snapshot s | "
        "checksums s (HBM) | snapshot share of NIC bytes | step ratio, serial | step ratio, "
        "overlapped |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, r in rows.items():
        lines.append(
            f"| {k} | {r['hosts']} | {r['zero']} | {r['compute_s']:.3f} | {r['collective_s']:.3f}"
            f" | {r['snapshot_to']} | {r['snapshot_s']:.4f} | {r['checksum_s']:.4f} | "
            f"{'-' if r['nic_share'] is None else format(r['nic_share'], '.1%')} | "
            f"{r['ratio_serial']:.4f} | {r['ratio_overlapped']:.4f} |"
        )
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "projection.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "projection.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

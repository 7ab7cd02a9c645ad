"""Stated device parameters for the simulator, each with its source. Nothing here is measured.

The simulator must never pass off a vendor number or a guess as a measurement, so every field
of a preset carries a comment naming where it comes from: a vendor spec sheet, a public report,
or "assumption" (ours, chosen to be typical and stated so a reader can change it). The one
measured quantity, per-layer compute on this machine's CPU, lives in `calibrate.py`.

Frequencies are relative to the nominal sustained clock f0 = 1.0. Power follows the DVFS model
of `dvfs.py`: P(f) = P_static + (P_nominal - P_static) * f^3.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator and its links. Bandwidths are bytes/s per device, one direction."""

    name: str
    peak_flops: float  # dense fp16/bf16 FLOP/s
    mfu: float  # fraction of peak achieved on the FLOP-counted work
    mem_bytes: float  # device memory
    intra_host_bw: float  # tensor-parallel collectives inside a host
    inter_host_bw: float  # data-parallel and pipeline traffic between hosts
    link_latency_s: float  # per collective hop
    devices_per_host: int
    power_w: float  # busy power at the nominal clock
    static_fraction: float  # P_static / P_nominal
    f_min: float  # lowest DVFS clock / f0
    f_max: float  # highest DVFS clock / f0
    mem_fraction: float  # share of a layer's compute time that does not scale with the clock
    storage_bw: float  # checkpoint read/write per device
    mem_usable: float = 0.9  # share of memory the runtime leaves to the model (assumption)


def ascend910() -> Device:
    """An Ascend-910-class NPU, the paper's hardware family (the exact NPU model is unknown)."""
    return Device(
        name="ascend910-like NPU",
        # 256 TFLOPS FP16: Huawei's Ascend 910 launch figures (Hot Chips 31, Aug 2019), as
        # reported by AnandTech / ServeTheHome coverage of that talk.
        peak_flops=256e12,
        # assumption: 40% MFU; Meta's Llama 3 report (2024) gives 38-43% BF16 MFU at scale.
        mfu=0.40,
        # 32 GB HBM2: Atlas 300T training card (Ascend 910) product page, as reported.
        mem_bytes=32e9,
        # HCCS: 3 ports x 240 Gb/s = 90 GB/s per chip (Hot Chips 31 coverage, as above).
        intra_host_bw=90e9,
        # RoCE v2: 2 x 100 Gb/s = 25 GB/s per chip (Hot Chips 31 coverage, as above).
        inter_host_bw=25e9,
        link_latency_s=5e-6,  # assumption
        devices_per_host=8,  # Atlas 800 training server: 8 x Ascend 910 (Huawei product page)
        power_w=310.0,  # "measured 310 W" (design 350 W): Huawei launch figures, as above
        static_fraction=0.3,  # assumption
        f_min=0.6,  # assumption
        f_max=1.15,  # assumption: boost headroom above the sustained training clock
        mem_fraction=0.2,  # assumption: memory-bound share of a layer (norms, softmax, ...)
        storage_bw=0.25e9,  # assumption: ~2 GB/s of checkpoint storage per 8-device host
    )


def h100_sxm() -> Device:
    """An NVIDIA H100 SXM5 (numbers from the NVIDIA H100 Tensor Core GPU datasheet)."""
    return Device(
        name="H100-SXM",
        peak_flops=989e12,  # datasheet: 989 TFLOPS dense BF16 (1979 with sparsity)
        mfu=0.40,  # assumption, as for ascend910 (Llama 3 report: 38-43%)
        mem_bytes=80e9,  # datasheet: 80 GB HBM3
        intra_host_bw=450e9,  # datasheet: NVLink 900 GB/s bidirectional = 450 GB/s each way
        inter_host_bw=50e9,  # one ConnectX-7 NDR 400 Gb/s NIC per GPU (DGX H100 datasheet)
        link_latency_s=5e-6,  # assumption
        devices_per_host=8,  # HGX H100 8-GPU board
        power_w=700.0,  # datasheet: max TDP up to 700 W (used as busy power at f0)
        static_fraction=0.3,  # assumption
        f_min=0.6,  # assumption
        f_max=1.15,  # assumption
        mem_fraction=0.2,  # assumption
        storage_bw=0.5e9,  # assumption: ~4 GB/s of checkpoint storage per 8-GPU host
    )


def cpu_device(flops: float, name: str = "this machine's CPU (calibrated)") -> Device:
    """This machine's CPU as a 'device' whose FLOP/s come from a calibration measurement.

    Used only to predict ratios between plans run on fake CPU devices (acceptance check);
    links are memory copies, so their bandwidth is a rough assumption with little effect.
    """
    return Device(
        name=name, peak_flops=flops, mfu=1.0, mem_bytes=float("inf"), intra_host_bw=5e9,
        inter_host_bw=5e9, link_latency_s=1e-5, devices_per_host=8, power_w=1.0,
        static_fraction=0.3, f_min=1.0, f_max=1.0, mem_fraction=0.0, storage_bw=1e9,
    )


def presets() -> dict[str, Device]:
    """Named presets (a fresh dict each call: no module-level mutable state)."""
    return {"ascend910": ascend910(), "h100_sxm": h100_sxm()}


__all__ = ["Device", "ascend910", "h100_sxm", "cpu_device", "presets"]

"""Device profiles and link classes: the figures the planner uses when nothing was measured.

Device figures are the published peaks from ../shared/reference/anchors-parallelism.md §3
with an achieved fraction applied, because no training loop runs at peak; link figures are
rated speeds with the TCP goodput a 1500-byte MTU allows (anchors-netmeasure.md §5) and a
round-trip time typical of kernel TCP plus a Python peer. `smoltrain calibrate` replaces
the guesses for this host with measured numbers.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from smolnet.errors import UsageError

GB = 1e9
GIB = 1024**3
DEFAULT_CALIBRATION = "~/.config/smolcluster/calibration.json"
CALIBRATION_SCHEMA = "smoltrain.calibration/1"


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    flops_fp32: float  # achieved FLOP/s for fp32 matmul-heavy work
    flops_fp16: float  # achieved FLOP/s for fp16/bf16
    mem_bw: float  # achieved memory bandwidth, bytes/s
    memory_bytes: float  # memory a training process may use (RAM or VRAM)
    peak_fp32: float  # published peak, for the record
    peak_mem_bw: float
    source: str
    flops_bf16: float | None = None  # measured apart from fp16 where calibrated (None: as flops_fp16)
    # weight bytes/s of a decode step's matrix products where calibrated: ((dtype, ((rows, bytes/s), ...)), ...)
    decode_bw: tuple = ()
    # seconds per layer a decode step spends beyond its products where calibrated: same layout
    decode_layer: tuple = ()
    # seconds a rank's decode engine spends per step beyond layers and messages, where calibrated
    decode_engine_s: float | None = None
    # seconds a burst of work costs more when it starts after the rank slept, where calibrated
    burst_wake_s: float | None = None

    def flops(self, dtype: str) -> float:
        if dtype == "bf16" and self.flops_bf16:
            return self.flops_bf16
        return self.flops_fp32 if dtype == "fp32" else self.flops_fp16

    def weight_rate(self, dtype: str | None, rows: int) -> tuple[float, str]:
        """(bytes/s, source) at which a decode step of `rows` rows reads its weights in `dtype`
        (None: quantised, never timed): the measured decode product, its seconds per byte
        linear in the rows between the row counts timed (beyond the last: the last two's slope),
        else the memory bandwidth. Few-row products stream weights slower than a copy."""
        pts = dict(self.decode_bw).get(dtype) if dtype else None
        if not pts:
            return self.mem_bw, DECODE_FROM_BANDWIDTH
        if rows <= pts[0][0]:  # the timed rate itself
            return pts[0][1], DECODE_FROM_MATMUL
        return 1 / by_rows(tuple((r, 1 / b) for r, b in pts), rows), DECODE_FROM_MATMUL

    def layer_overhead(self, dtype: str, rows: int) -> float | None:
        """Seconds per layer of a decode step of `rows` rows beyond its matrix products (the
        measured block's norms, rotary tables, attention, activations), linear in the rows
        between the row counts timed; None where not calibrated."""
        pts = dict(self.decode_layer).get(dtype) or dict(self.decode_layer).get("fp32")
        return by_rows(pts, rows) if pts else None

    def decode_scaled(self, f: float) -> dict:
        """decode_bw, decode_layer, decode_engine_s and burst_wake_s for a rank with a share f of a
        machine (rates times f, seconds over f), as `replace` arguments."""
        return {
            "decode_bw": tuple((dt, tuple((r, b * f) for r, b in pts)) for dt, pts in self.decode_bw),
            "decode_layer": tuple((dt, tuple((r, t / f) for r, t in pts)) for dt, pts in self.decode_layer),
            "decode_engine_s": None if self.decode_engine_s is None else self.decode_engine_s / f,
            "burst_wake_s": None if self.burst_wake_s is None else self.burst_wake_s / f,
        }

    def to_dict(self) -> dict:
        return asdict(self)


def by_rows(pts: tuple, rows: int) -> float:
    """A cost timed at a few row counts ((rows, cost), ascending), at `rows`: linear between
    the rows timed, the first below them; beyond the last the last two's slope goes on,
    never downward (more rows never cost less than the most timed)."""
    if len(pts) == 1 or rows <= pts[0][0]:
        return pts[0][1]
    (r0, c0), (r1, c1) = next(((a, b) for a, b in zip(pts, pts[1:]) if rows <= b[0]), pts[-2:])
    slope = (c1 - c0) / (r1 - r0)
    if rows > r1:
        return c1 + (rows - r1) * max(0.0, slope)
    return c0 + (rows - r0) * slope


DECODE_FROM_MATMUL = "decode matmul"  # calibrate timed this host's few-row products (decode_bw_bytes_s)
DECODE_FROM_BANDWIDTH = "memory bandwidth"  # a copy's rate (calibrate) or the device profile's


# Achieved = peak x 0.4 for compute (Pi 5 HPL reaches ~0.4 of its FP64 peak; MFU of small
# training loops is in the same range) and the measured copy bandwidth where one is known.
ACHIEVED = 0.4
DEVICES: dict[str, DeviceProfile] = {
    "pi4": DeviceProfile(
        "pi4",
        48e9 * ACHIEVED,
        48e9 * ACHIEVED,
        4.0 * GB,
        4 * GIB,
        48e9,
        12.8 * GB,
        "4x A72 1.5 GHz x 8 FLOP/cycle (derived); LPDDR4-3200 32-bit; 4 GB model",
    ),
    "pi5": DeviceProfile(
        "pi5",
        154e9 * ACHIEVED,
        308e9 * ACHIEVED,
        6.2 * GB,
        8 * GIB,
        154e9,
        17.1 * GB,
        "4x A76 2.4 GHz (derived peak); tinymembench copy 6.2 GB/s; 8 GB model",
    ),
    "jetson-orin-nano": DeviceProfile(
        "jetson-orin-nano",
        1.28e12 * ACHIEVED,
        10e12 * ACHIEVED * 0.5,
        68 * GB * 0.7,
        8 * GB,
        1.28e12,
        68 * GB,
        "NVIDIA datasheet (non-Super clocks); 8 GB shared memory",
    ),
    "mac-mini-m4": DeviceProfile(
        "mac-mini-m4",
        4.26e12 * ACHIEVED,
        8.5e12 * ACHIEVED * 0.5,
        120 * GB * 0.7,
        16 * GB,
        4.26e12,
        120 * GB,
        "Apple M4 10-core GPU; 16 GB unified memory (base model)",
    ),
    "rtx4050-laptop": DeviceProfile(
        "rtx4050-laptop",
        10e12 * ACHIEVED,
        20e12 * ACHIEVED,
        192 * GB * 0.7,
        6 * GIB,
        10e12,
        192 * GB,
        "20 SM, 8-12 TFLOPS by TGP (10 taken); 6 GB GDDR6 96-bit",
    ),
    "generic": DeviceProfile(
        "generic",
        100e9 * ACHIEVED,
        100e9 * ACHIEVED,
        10 * GB,
        16 * GIB,
        100e9,
        20 * GB,
        "a modest x86 CPU; run `smoltrain calibrate` to measure this host",
    ),
}


@dataclass(frozen=True)
class LinkClass:
    name: str
    rated_mbit: float
    goodput_mbit: float  # realistic TCP goodput
    rtt_us: float  # application-level round trip of a small message
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


LINK_CLASSES: dict[str, LinkClass] = {
    "1gbe": LinkClass("1gbe", 1_000, 941, 200, "TCP ceiling at MTU 1500 (1448/1538)"),
    "2.5gbe": LinkClass("2.5gbe", 2_500, 2_354, 150, "TCP ceiling at MTU 1500; ~2.3 Gb/s cited"),
    "10gbe": LinkClass("10gbe", 10_000, 9_415, 60, "TCP ceiling at MTU 1500"),
    "25gbe": LinkClass("25gbe", 25_000, 23_500, 50, "TCP ceiling at MTU 1500"),
    "100gbe": LinkClass("100gbe", 100_000, 94_100, 40, "TCP ceiling; kernel TCP RTT 20-60 us"),
    "200gbe": LinkClass("200gbe", 200_000, 160_000, 40, "iperf3 >= 3.16 reaches ~160 Gb/s"),
    "tb4": LinkClass("tb4", 40_000, 16_400, 130, "Thunderbolt 4 P2P: iperf3 16.4 Gb/s at MTU 1500, 65 us one way"),
    "tb5": LinkClass("tb5", 80_000, 32_800, 100, "Thunderbolt 5: no TCP figure published; 2x TB4 assumed"),
    "loopback": LinkClass(
        "loopback",
        80_000,
        8_000,
        50,
        "one machine: Python sockets move ~1 GB/s, RTT 15-60 us (plan default for --local)",
    ),
}


def get_device(name: str) -> DeviceProfile:
    try:
        return DEVICES[name]
    except KeyError:
        raise UsageError(f"unknown device profile {name!r} (one of {', '.join(DEVICES)})") from None


def get_link_class(name: str) -> LinkClass:
    key = str(name).lower()
    if key not in LINK_CLASSES:
        raise UsageError(f"unknown link class {name!r} (one of {', '.join(LINK_CLASSES)})")
    return LINK_CLASSES[key]


def calibration_path(path: str | None = None) -> Path:
    return Path(os.path.expanduser(path or os.environ.get("SMOL_CALIBRATION", DEFAULT_CALIBRATION)))


def profile_from_calibration(doc: dict, origin: str = "calibration") -> DeviceProfile:
    """A `generic` profile built from what `smoltrain calibrate` measured on a host."""
    from smoltrain.schema import check

    check(doc, CALIBRATION_SCHEMA, origin)
    try:
        f32 = float(doc["flops_fp32"])
        f16 = float(doc.get("flops_fp16") or f32)
        bw = float(doc["mem_bw"])
        mem = float(doc.get("memory_bytes") or DEVICES["generic"].memory_bytes)
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"{origin}: calibration lacks flops_fp32 or mem_bw") from None
    if f32 <= 0 or bw <= 0:
        raise UsageError(f"{origin}: calibration figures must be positive")
    # The measured matmul rate is a peak for this host; apply the same achieved fraction.
    eff = float(doc.get("train_efficiency", ACHIEVED))
    return DeviceProfile(
        "generic",
        f32 * eff,
        f16 * eff,
        bw,
        mem,
        f32,
        bw,
        f"calibrated on {doc.get('host', '?')} at {doc.get('created', '?')}",
        float(doc["flops_bf16"]) * eff if doc.get("flops_bf16") else None,
    )


def load_calibration(path: str | None = None, required: bool = False) -> DeviceProfile | None:
    p = calibration_path(path)
    if not p.exists():
        if required:
            raise UsageError(f"{p}: no calibration file (run `smoltrain calibrate --out {p}`)")
        return None
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{p}: cannot read calibration: {e}") from None
    return profile_from_calibration(doc, str(p))

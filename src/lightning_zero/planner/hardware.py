"""Hardware: a link's cost of one collective, and the configs (``conf/hardware/*.yaml``): memory,
links, peak FLOP/s, memory bandwidth.

The default hardware is the one ``conf/config.yaml`` selects (its ``hardware:`` default), read
from that file, so the planner's Python default and the CLI's are the same by construction.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

from lightning_zero.comm.ring import ring_sent, ring_steps

COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")  # all_to_all: cp (Ulysses)


# --------------------------------------------------------------------------------------------
# One collective
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One link class as one rank sees it: per-step latency (s) and bandwidth (bytes/s, one way)."""

    latency_s: float
    bytes_per_s: float
    time_factor: tuple[tuple[str, float], ...] = ()  # per collective kind, from a calibration

    def factor(self, kind: str) -> float:
        for name, value in self.time_factor:
            if name == kind:
                return value
        return 1.0


def collective_seconds(kind: str, payload_bytes: float, ranks: int, link: Link) -> float:
    """``factor x (steps x latency + sent_bytes / bandwidth)`` with the ring's steps and bytes
    (``lightning_zero/comm/ring.py``); 0 for a group of one rank. ``kind``: one of ``COLLECTIVE_KINDS``."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"collective kind must be one of {COLLECTIVE_KINDS}, got {kind!r}")
    if ranks <= 1 or payload_bytes <= 0:
        return 0.0
    return link.factor(kind) * (
        ring_steps(kind, ranks) * link.latency_s + ring_sent(kind, payload_bytes, ranks) / link.bytes_per_s
    )


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
HARDWARE_DIR = CONF_DIR / "hardware"

# Defaults for fields a hardware YAML may leave out (documented in docs/planner.md).
DEFAULT_LATENCY_US = {"intra": 5.0, "inter": 10.0}
DEFAULT_OVERLAP_EFFICIENCY = 1.0
DEFAULT_MFU = 0.4


def _read_yaml(path: Path) -> dict[str, Any]:
    """A plain YAML mapping, read with PyYAML (a Lightning dependency), not OmegaConf: the planner
    runs where Hydra and OmegaConf are not installed (the GPU check, docs/gpu.md). Hardware files
    use no interpolation, so the two readers agree."""
    import yaml

    with open(path) as stream:
        values = yaml.safe_load(stream)
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a YAML mapping, got {type(values).__name__}")
    return values


@functools.lru_cache(maxsize=1)
def default_hardware_name() -> str:
    """The ``hardware`` entry of ``conf/config.yaml``'s defaults list (the one place it is written)."""
    for entry in _read_yaml(CONF_DIR / "config.yaml")["defaults"]:
        if isinstance(entry, dict) and "hardware" in entry:
            return str(entry["hardware"])
    raise RuntimeError(f"{CONF_DIR / 'config.yaml'} selects no hardware in its defaults list")


@dataclass(frozen=True)
class Hardware:
    """One accelerator in its usual node. Bandwidths are per device, one direction, bytes/s."""

    name: str
    memory_bytes: int
    intra_node_bytes_per_s: float  # NVLink: tp collectives, and dp inside one node
    inter_node_bytes_per_s: float  # network per device: dp collectives across nodes
    peak_bf16_flops: float
    peak_fp32_flops: float
    devices_per_node: int = 8
    intra_node_latency_s: float = DEFAULT_LATENCY_US["intra"] * 1e-6  # per ring step
    inter_node_latency_s: float = DEFAULT_LATENCY_US["inter"] * 1e-6
    memory_bytes_per_s: float = float("inf")  # device memory bandwidth (gradient copies; optimizer step)
    optimizer_bytes_per_s: Optional[float] = None  # the optimizer step's own rate (None: memory_bytes_per_s)
    overlap_efficiency: float = DEFAULT_OVERLAP_EFFICIENCY  # [Note: step-time model] in timing.py
    mfu: Optional[float] = None  # calibrated compute efficiency (plan.mfu=null uses it)
    collective_time_factor: tuple[tuple[str, float], ...] = ()
    # Fixed seconds per optimizer step the step-time model does not count (the training loop's
    # hooks, logging, scheduler and optimizer bookkeeping; measured by `plan calibrate`). 0 on GPU
    # presets: there the loop's milliseconds hide under asynchronous kernel launches.
    step_overhead_s: float = 0.0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "Hardware":
        """From a ``conf/hardware/*.yaml`` mapping (GB/s, TFLOP/s and microseconds, as written there)."""
        required = ("name", "memory_bytes", "intra_node_gb_per_s", "inter_node_gb_per_s", "peak_bf16_tflops")
        missing = [key for key in required if values.get(key) is None]
        if missing:
            raise ValueError(f"hardware config misses {missing}; see {HARDWARE_DIR}/h100_80gb.yaml for the keys")

        def number(key: str, default: Any = None) -> Any:
            value = values.get(key)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"hardware.{key} must be a number, got {value!r}")
            return value

        factors = values.get("collective_time_factor") or {}
        efficiency = float(number("overlap_efficiency", DEFAULT_OVERLAP_EFFICIENCY))
        if not 0.0 <= efficiency <= 1.0:
            raise ValueError(f"hardware.overlap_efficiency must be in [0, 1], got {efficiency}")
        overhead_ms = float(number("step_overhead_ms", 0.0))
        if overhead_ms < 0:
            raise ValueError(
                f"hardware.step_overhead_ms must be >= 0 (milliseconds per optimizer step), got {overhead_ms}"
            )
        memory_gbps = number("memory_gb_per_s")
        optimizer_gbps = number("optimizer_gb_per_s")
        return cls(
            name=str(values["name"]),
            memory_bytes=int(number("memory_bytes")),
            intra_node_bytes_per_s=float(number("intra_node_gb_per_s")) * 1e9,
            inter_node_bytes_per_s=float(number("inter_node_gb_per_s")) * 1e9,
            peak_bf16_flops=float(number("peak_bf16_tflops")) * 1e12,
            peak_fp32_flops=float(number("peak_fp32_tflops", number("peak_bf16_tflops") / 16)) * 1e12,
            devices_per_node=int(number("devices_per_node", 8)),
            intra_node_latency_s=float(number("intra_node_latency_us", DEFAULT_LATENCY_US["intra"])) * 1e-6,
            inter_node_latency_s=float(number("inter_node_latency_us", DEFAULT_LATENCY_US["inter"])) * 1e-6,
            memory_bytes_per_s=float(memory_gbps) * 1e9 if memory_gbps is not None else float("inf"),
            optimizer_bytes_per_s=float(optimizer_gbps) * 1e9 if optimizer_gbps is not None else None,
            overlap_efficiency=efficiency,
            mfu=None if values.get("mfu") is None else float(number("mfu")),
            collective_time_factor=tuple(sorted((str(k), float(v)) for k, v in dict(factors).items())),
            step_overhead_s=overhead_ms * 1e-3,
        )

    def link(self, inter_node: bool) -> Link:
        """The link a collective runs on: across nodes, or inside one."""
        if inter_node:
            return Link(self.inter_node_latency_s, self.inter_node_bytes_per_s, self.collective_time_factor)
        return Link(self.intra_node_latency_s, self.intra_node_bytes_per_s, self.collective_time_factor)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def available_hardware() -> list[str]:
    return sorted(path.stem for path in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(hardware: Union[str, Path, Hardware, Mapping[str, Any], None] = None) -> Hardware:
    """A :class:`Hardware` from a name in ``conf/hardware`` (``h100_80gb``), a YAML path, a mapping,
    or itself; ``None`` is ``conf/config.yaml``'s default."""
    if hardware is None:
        hardware = default_hardware_name()
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, Mapping):
        return Hardware.from_mapping(hardware)
    path = Path(hardware)
    if path.suffix not in (".yaml", ".yml") or not path.is_file():
        path = HARDWARE_DIR / f"{hardware}.yaml"
    if not path.is_file():
        raise ValueError(
            f"unknown hardware {str(hardware)!r}; pick one of {available_hardware()} (hardware=NAME) "
            "or give a YAML path"
        )
    return Hardware.from_mapping(_read_yaml(path))

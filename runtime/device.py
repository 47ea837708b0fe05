"""Device probe: what this machine is (CPU, memory, storage behind a file, GPU, Jetson).

Facts come from the OS (/proc, sysfs) and NVML when it exists; on Jetson NVML reports
NotSupported, so the board is recognised from /etc/nv_tegra_release or the device tree.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field


@dataclass
class DeviceFacts:
    cpu_model: str
    cpu_cores: int
    memory_bytes: int
    platform: str
    jetson: str | None = None
    gpus: list[dict] = field(default_factory=list)
    block_device: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Hardware", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _jetson() -> str | None:
    for path in ("/etc/nv_tegra_release", "/proc/device-tree/model"):
        try:
            with open(path, "rb") as f:
                text = f.read(256).decode(errors="replace").strip("\x00\n ")
        except OSError:
            continue
        if path.endswith("nv_tegra_release") or "jetson" in text.lower() or "orin" in text.lower():
            return text.splitlines()[0]
    return None


def _gpus() -> list[dict]:
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded: no usable NVIDIA GPU
        return []
    gpus = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            info = {"index": i, "name": pynvml.nvmlDeviceGetName(h)}
            try:
                info["memory_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
                info["pcie_gen"] = int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h))
                info["pcie_width"] = int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(h))
            except Exception:
                pass  # NotSupported on some boards; keep what we have
            gpus.append(info)
    finally:
        pynvml.nvmlShutdown()
    return gpus


def block_device_of(path: str) -> dict | None:
    """The block device holding ``path`` (sysfs): name, rotational, queue limits."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    major, minor = os.major(dev), os.minor(dev)
    base = f"/sys/dev/block/{major}:{minor}"
    if not os.path.exists(base):
        return {"major": major, "minor": minor}
    real = os.path.realpath(base)
    disk = real if os.path.exists(os.path.join(real, "queue")) else os.path.dirname(real)

    def read(rel):
        try:
            with open(os.path.join(disk, rel)) as f:
                return f.read().strip()
        except OSError:
            return None

    return {
        "name": os.path.basename(disk),
        "model": read("device/model"),
        "rotational": read("queue/rotational") == "1",
        "max_sectors_kb": read("queue/max_sectors_kb"),
        "logical_block_size": read("queue/logical_block_size"),
    }


def probe(model_path: str | None = None) -> DeviceFacts:
    return DeviceFacts(
        cpu_model=_cpu_model(),
        cpu_cores=os.cpu_count() or 1,
        memory_bytes=_memory_bytes(),
        platform=f"{platform.system()} {platform.release()} {platform.machine()}",
        jetson=_jetson(),
        gpus=_gpus(),
        block_device=block_device_of(model_path) if model_path else None,
    )

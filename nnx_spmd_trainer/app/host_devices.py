"""Devices for a run on a machine without an accelerator: CPU devices simulated for XLA.

Which platform JAX may pick is decided from the environment and the installed plugins,
without starting a backend, so ``XLA_FLAGS`` can still be set.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import pathlib
import pkgutil
import sys

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def _has_accelerator() -> bool:
    """Whether JAX may pick a non-CPU backend, decided without starting one."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return any(p.strip() not in ("", "cpu") for p in platforms.split(","))
    # libtpu is also installed where no TPU is (the tpu-plan extra compiles for chips that are
    # not here): it counts only beside a chip on the PCI bus, as JAX's own check reads it.
    if importlib.util.find_spec("libtpu") is not None and _tpu_chips_attached():
        return True
    # The same for jax's CUDA plugin (the gpu-plan extra compiles for GPUs that are not
    # here): it counts only beside an NVIDIA device on the PCI bus.
    names = [entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")]
    try:
        import jax_plugins  # namespace package of the CUDA/ROCm plugins
    except ImportError:
        pass
    else:
        names += [module.name for module in pkgutil.iter_modules(jax_plugins.__path__)]
    return any("cuda" not in name or _attached(NVIDIA) for name in names)


#: PCI vendor ids: Google's (TPU chips) and NVIDIA's.
GOOGLE, NVIDIA = "0x1ae0", "0x10de"


def _attached(vendor_id: str) -> bool:
    """Whether a device of ``vendor_id`` sits on this machine's PCI bus."""
    return any(
        pathlib.Path(vendor).read_text().strip() == vendor_id
        for vendor in glob.glob("/sys/bus/pci/devices/*/vendor")
    )


def _tpu_chips_attached() -> bool:
    """Whether a Google TPU chip sits on this machine's PCI bus."""
    return _attached(GOOGLE)


def simulate_host_devices(num_devices: int) -> None:
    """Asks XLA for ``num_devices`` CPU devices, unless XLA_FLAGS already sets a count.

    Must run before JAX starts its backend (importing jax is fine); does
    nothing when an accelerator may be present.
    """
    flags_now = os.environ.get("XLA_FLAGS", "")
    if HOST_DEVICES_FLAG in flags_now or _has_accelerator():
        return
    os.environ["XLA_FLAGS"] = f"{flags_now} {HOST_DEVICES_FLAG}={num_devices}".strip()
    # No accelerator: keep JAX on the CPU, so an installed libtpu with no chip beside it is not
    # started (it prints four lines of warnings, and can wait seconds for a metadata server).
    if "JAX_PLATFORMS" not in os.environ:
        os.environ["JAX_PLATFORMS"] = "cpu"
        if "jax" in sys.modules:  # jax read the variable at its import: tell its config too
            sys.modules["jax"].config.update("jax_platforms", "cpu")

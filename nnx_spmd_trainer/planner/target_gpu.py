"""GPUs described, not present: XLA's compile-only CUDA topology, for a ``Target`` of
H100s (``planner/target.py``).

jax's CUDA plugin makes a topology of GPUs from a description of one GPU (XLA's
``GpuTargetConfigProto``, in text) and a shape, ``"<partitions>x<hosts>x<GPUs a
host>"``; a plan's programs are then compiled for those GPUs by XLA's GPU compiler on
this CPU (``jax.experimental.topologies.get_topology_desc(platform="cuda", ...)``).
Needs the plugin (``pip install 'nnx-spmd-trainer[gpu-plan]'``), not a GPU nor CUDA.
"""

from __future__ import annotations

import functools
import importlib.util

import jax

#: The extra that installs jax's CUDA plugin, named where it is missing.
EXTRA = "pip install 'nnx-spmd-trainer[gpu-plan]'"

#: One H100 SXM as XLA's GPU compiler sees it (the fields of XLA's own description of
#: the H100 SXM that the compiler reads: its sizes, limits and compute capability).
H100_SXM = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 1 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

#: Each GPU generation's description, by the target table's name.
DESCRIPTIONS = {"h100": H100_SXM}


def cuda_plugin_installed() -> bool:
    return importlib.util.find_spec("jax_cuda12_plugin") is not None


@functools.cache
def topology_devices(generation: str, per_host: int, hosts: int) -> list[jax.Device]:
    """The plugin's compile-only description of ``hosts`` x ``per_host`` GPUs (cached:
    one per process). A device's ``process_index`` is its host. The plugin must be
    installed (``cuda_plugin_installed``)."""
    from jax.experimental import topologies

    described = topologies.get_topology_desc(
        platform="cuda",
        topology_name=f"{generation}:{hosts}x{per_host}",
        target_config=DESCRIPTIONS[generation],
        topology=f"1x{hosts}x{per_host}",
    )
    return list(described.devices)

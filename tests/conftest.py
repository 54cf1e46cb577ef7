"""Eight simulated CPU devices for every test, set once before JAX starts its backend.

The CPU is the platform of every test process and of the commands they start,
whatever accelerator the machine has: a GPU would otherwise become the
default backend, with one device where the tests expect eight. The GPU tests
(``test_gpu.py``) start their own processes on the GPU.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["JAX_PLATFORMS"] = "cpu"

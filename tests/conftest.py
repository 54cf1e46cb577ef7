"""Eight simulated CPU devices for every test, set once before JAX starts its backend.

The CPU is the platform of every test process and of the commands they start,
whatever accelerator the machine has: a GPU would otherwise become the
default backend, with one device where the tests expect eight. The GPU tests
(``test_gpu.py``) start their own processes on the GPU.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["JAX_PLATFORMS"] = "cpu"

# One persistent compilation cache for the session and every process it starts (CLI
# runs, multi-process workers): the same small programs compile once, not once per
# process. Entries are keyed by the program, the compile options and XLA_FLAGS, so none
# is ever served for another program; the directory goes with the session.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="nnx-spmd-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

"""Eight simulated CPU devices for every test, set once before JAX starts its backend."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

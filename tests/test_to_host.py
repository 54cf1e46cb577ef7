"""``data.to_host``: arrays leaving the devices, gathered whole to every host or freed."""

from __future__ import annotations

import io
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_spmd_trainer import distributed
from nnx_spmd_trainer.data.to_host import delete_arrays, gather_to_host


def test_one_process_gets_each_leaf_whole_as_numpy_and_frees_on_request():
    mesh = jax.make_mesh((8,), ("data",))
    values = np.arange(32, dtype=np.float32).reshape(8, 4)
    sharded = jax.device_put(values, NamedSharding(mesh, P("data")))
    host = gather_to_host({"a": sharded, "b": [jnp.ones(3), 2.0]})
    assert isinstance(host["a"], np.ndarray) and isinstance(host["b"][0], np.ndarray)
    np.testing.assert_array_equal(host["a"], values)
    np.testing.assert_array_equal(host["b"][0], np.ones(3))
    delete_arrays({"a": sharded, "keep": values})
    assert sharded.is_deleted()


@pytest.mark.slow
@pytest.mark.serial
def test_two_processes_each_get_the_whole_of_an_array_split_over_both(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import numpy as np, jax\n"
        "from jax.sharding import NamedSharding, PartitionSpec as P\n"
        "from nnx_spmd_trainer import distributed\n"
        "from nnx_spmd_trainer.data.to_host import gather_to_host\n"
        "assert distributed.initialize()\n"
        "mesh = jax.make_mesh((8,), ('data',))\n"
        "values = np.arange(16, dtype=np.float32).reshape(8, 2)\n"
        "x = jax.make_array_from_callback((8, 2), NamedSharding(mesh, P('data')),\n"
        "                                 lambda index: values[index])\n"
        "assert not x.is_fully_addressable\n"
        "host = gather_to_host({'x': x})['x']\n"
        "print('whole:', type(host).__name__, host.shape, float(host.sum()), flush=True)\n"
    )
    log = io.StringIO()
    status = distributed.Launch([sys.executable, str(script)], 2, out=log).run()
    assert status == 0, log.getvalue()[-4000:]
    for process in (0, 1):  # 0 + 1 + ... + 15 = 120 on both: every row, from both processes
        assert f"[{process}] whole: ndarray (8, 2) 120.0" in log.getvalue(), log.getvalue()[-2000:]

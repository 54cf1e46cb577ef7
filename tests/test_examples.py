"""Every script in examples/ runs with its tiny default settings and passes its own check."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).parent.parent / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.py"))


def test_every_example_is_listed_in_the_examples_readme():
    readme = (EXAMPLES / "README.md").read_text()
    assert SCRIPTS, "no examples found"
    assert [s.name for s in SCRIPTS if f"`{s.name}`" not in readme] == []


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_the_example_runs_and_checks_its_result(script, tmp_path):
    args = ["--workdir", str(tmp_path)] if script.stem == "gpt_fsdp_tp" else []
    # The environment of the tests: 8 simulated CPU devices (conftest.py).
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert f"OK: {script.stem}:" in done.stdout, output[-4000:]
    assert "FAILED" not in done.stdout

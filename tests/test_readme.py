"""The README's tour runs as written, and does what it says."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.slow
def test_readme_tour_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)  # it writes runs/tour
    exec(compile(blocks[0], "README.md", "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(" ")[0] for line in lines] == ["DataParallel()", "FSDP()", "Hybrid(FSDP(4),"]
    assert lines[-1].endswith("P('fsdp', 'model')")  # born sharded on both axes
    assert list((tmp_path / "runs" / "tour").glob("events.out.tfevents.*"))

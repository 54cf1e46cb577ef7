"""The README's tour runs as written, and does what it says; its other snippets parse and
import what exists."""

import ast
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_every_other_snippet_parses_and_imports_what_exists():
    """The snippets after the tour are fragments (they use the tour's names and data):
    each parses, and its imports name modules and names that exist."""
    for block in python_blocks()[1:]:
        tree = ast.parse(block)
        imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
        exec(compile(ast.Module(body=imports, type_ignores=[]), "README.md", "exec"), {})


@pytest.mark.slow
def test_readme_tour_runs(tmp_path, monkeypatch, capsys):
    blocks = python_blocks()
    monkeypatch.chdir(tmp_path)  # it writes runs/tour
    exec(compile(blocks[0], "README.md", "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(" ")[0] for line in lines] == ["DataParallel()", "FSDP()", "Hybrid(FSDP(4),"]
    assert lines[-1].endswith("P('fsdp', 'model')")  # born sharded on both axes
    assert list((tmp_path / "runs" / "tour").glob("events.out.tfevents.*"))

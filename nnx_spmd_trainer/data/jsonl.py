"""JSONL rows read with where they came from, for the readers that name a bad row's line
(chat conversations, preference pairs, prompts)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any


def jsonl_rows(
    path: str | os.PathLike[str], error: type[Exception] = ValueError
) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each non-blank line of a JSONL file, ``where`` being
    ``"FILE:LINE"``; a line that is not JSON raises ``error`` naming it.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
    ...     _ = f.write('{"a": 1}\\n\\n[2]\\n')
    >>> [row for _, row in jsonl_rows(f.name)]
    [{'a': 1}, [2]]
    """
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as decode:
                raise error(f"{where}: not a JSON object ({decode.msg}).") from None
            yield where, row

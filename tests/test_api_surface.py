"""The public API holds still: ``__all__``, the documented attributes and every public
signature, against the snapshot in ``api_surface.txt``; a renamed name warns and works.

A deliberate change: ``python tests/test_api_surface.py`` rewrites the snapshot;
the CHANGELOG says what changed, and a renamed or moved name keeps working for a
release with a ``DeprecationWarning`` (``nnx_spmd_trainer.deprecation``).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import sys
import warnings
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("api_surface.txt")
MODULES = (
    "nnx_spmd_trainer",
    "nnx_spmd_trainer.callbacks",
    "nnx_spmd_trainer.data",
    "nnx_spmd_trainer.weights",
    "nnx_spmd_trainer.post_training",
    "nnx_spmd_trainer.app",
    "nnx_spmd_trainer.optim",
    "nnx_spmd_trainer.nn",
)


def _parameters(obj: object) -> str:
    """Names, kinds and whether each has a default: what a caller's code depends on
    (defaults' values and annotations are left out: their reprs move with Flax)."""
    try:
        signature = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"
    parts, star = [], False
    for p in signature.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        star |= p.kind is p.VAR_POSITIONAL
        parts.append(prefix + p.name + ("=" if p.default is not p.empty else ""))
    return f"({', '.join(parts)})"


def _documented_attributes(cls: type) -> list[str]:
    """The names under ``Attributes:`` in a class docstring."""
    doc = inspect.getdoc(cls) or ""
    section = re.search(r"^Attributes:\n((?:(?:  .*)?\n?)*)", doc, re.MULTILINE)
    return re.findall(r"^  (\w+)(?:, (\w+))*:", section.group(1), re.MULTILINE) if section else []


def _members(cls: type) -> dict[str, object]:
    """The class's own members and those of its private mixins (a base of this package that
    is not public itself: ``Trainer``'s ``RunAccess``), which are the class's surface. A
    private base that a public base of the class already brings (``Callback``'s
    ``BaseCallback``, under every shipped callback) is that public base's surface."""
    public = {
        id(getattr(importlib.import_module(m), n))
        for m in MODULES
        for n in importlib.import_module(m).__all__
    }
    through_public = {id(b) for base in cls.__mro__[1:] if id(base) in public for b in base.__mro__}
    members: dict[str, object] = {}
    for base in reversed(cls.__mro__):
        private = (
            base.__module__.startswith("nnx_spmd_trainer")
            and id(base) not in public
            and id(base) not in through_public
        )
        if base is cls or private:
            members.update(vars(base))
    return members


def _class_lines(name: str, cls: type) -> list[str]:
    lines = [f"{name}{_parameters(cls)}"]
    for member, value in sorted(_members(cls).items()):
        if member.startswith("_"):
            continue
        if isinstance(value, property):
            lines.append(f"{name}.{member} [property]")
        elif isinstance(value, staticmethod | classmethod) or inspect.isfunction(value):
            lines.append(f"{name}.{member}{_parameters(getattr(cls, member))}")
        else:
            lines.append(f"{name}.{member} [attribute]")
    for found in _documented_attributes(cls):
        for attribute in filter(None, found):
            lines.append(f"{name}.{attribute} [documented]")
    return lines


def surface() -> list[str]:
    lines = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(module.__all__):
            value = getattr(module, name)
            qualified = f"{module_name}.{name}"
            if inspect.isclass(value):
                lines.extend(_class_lines(qualified, value))
            elif inspect.ismodule(value):
                lines.append(f"{qualified} [module]")
            elif callable(value):
                lines.append(f"{qualified}{_parameters(value)}")
            else:
                lines.append(f"{qualified} [value]")
    return lines


def test_the_public_api_matches_its_snapshot():
    expected = SNAPSHOT.read_text().splitlines()
    actual = surface()
    diff = "\n".join(difflib.unified_diff(expected, actual, "api_surface.txt", "now", lineterm=""))
    assert actual == expected, (
        "The public API changed. If that is deliberate, run `python tests/test_api_surface.py` "
        "to rewrite tests/api_surface.txt, say so in CHANGELOG.md, and keep a renamed or "
        "moved name working for a release (nnx_spmd_trainer.deprecation):\n" + diff
    )


def test_a_renamed_attribute_warns_once_and_still_works():
    import numpy as np
    import optax
    from toy_models import Net, classification_loss, make_batches

    from nnx_spmd_trainer import Trainer, deprecation

    deprecation._warned.discard("Trainer.stop_training")
    trainer = Trainer(Net, optax.sgd(0.1), loss_fn=classification_loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert trainer.stop_training is False  # reads through to stop_requested
        trainer.stop_training = True  # Keras's way to stop: still stops
        assert trainer.stop_requested
    (warning,) = caught  # once, though used twice
    assert warning.category is DeprecationWarning
    assert "Trainer.stop_training" in str(warning.message)
    assert "request_stop()" in str(warning.message)

    class StopAtTwo(__import__("nnx_spmd_trainer").Callback):
        def on_train_batch_end(self, step, logs):
            if step == 2:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self.trainer.stop_training = True

    trainer = Trainer(Net, optax.sgd(0.1), loss_fn=classification_loss, callbacks=[StopAtTwo()])
    trainer.fit(make_batches(4), max_steps=4)
    assert trainer.step == 2 and np.isfinite(trainer.history.history["train/loss"][-1])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    import conftest  # noqa: F401 - the devices the tests see

    SNAPSHOT.write_text("\n".join(surface()) + "\n")
    print(f"wrote {SNAPSHOT}")


def test_generate_log_probabilities_warns_and_still_gives_the_log_softmax():
    """Removed from ``generate.__all__`` (one log-probability implementation): kept for a
    release, warning, and still the raw log-softmax (checked against its definition)."""
    import numpy as np

    import nnx_spmd_trainer.generate as generate
    from nnx_spmd_trainer import deprecation

    deprecation._warned.discard("nnx_spmd_trainer.generate.log_probabilities")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = generate.log_probabilities
    assert [w.category for w in caught] == [DeprecationWarning]
    assert "nn.token_log_probs" in str(caught[0].message)
    logits = np.array([[1.0, 2.0, 0.5]], np.float32)
    want = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(fn(logits)), want, rtol=1e-6)

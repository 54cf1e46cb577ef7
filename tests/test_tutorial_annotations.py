"""Annotations in the JAX AI Stack tutorials' form (issue 16): a ``NamedSharding`` over the
tutorial's own mesh, or a ``PartitionSpec``, read against the trainer's mesh; an
annotation of any other type is an error naming the parameter; a Hybrid member can answer
an annotation the joint resolution cannot read."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from toy_models import (
    LECUN,
    assert_params_match,
    classification_loss,
    make_batches,
    train_reference,
)

from nnx_spmd_trainer import DataParallel, Hybrid, Plan, ShardingError, TensorParallel, Trainer
from nnx_spmd_trainer import sharding as sh

# The tutorials' own mesh: built apart from the trainer's, axes ('batch', 'model').
TUTORIAL_MESH = Mesh(mesh_utils.create_device_mesh((4, 2)), ("batch", "model"))


class TutorialNet(nnx.Module):
    """Annotated as the tutorials do: NamedSharding over their mesh (l1), and a bare
    PartitionSpec (the bias of l1, w2)."""

    def __init__(self, rngs: nnx.Rngs, din: int = 16, hidden: int = 32, dout: int = 8) -> None:
        self.l1 = nnx.Linear(
            din,
            hidden,
            kernel_init=nnx.with_partitioning(
                LECUN, NamedSharding(TUTORIAL_MESH, P(None, "model"))
            ),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), P("model")),
            rngs=rngs,
        )
        self.w2 = nnx.Param(LECUN(rngs.params(), (hidden, dout)), out_sharding=P("model", None))

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.relu(self.l1(x)) @ self.w2[...]


def model_specs(plan: Plan) -> dict[str, P]:
    shardings = nnx.to_flat_state(plan.shardings["model"])
    return {"/".join(map(str, path)): s.spec for path, s in shardings}


TUTORIAL_SPECS = {"l1/kernel": P(None, "model"), "l1/bias": P("model"), "w2": P("model")}


def test_tutorial_annotations_train_like_one_device_and_keep_their_specs():
    strategy = Hybrid(DataParallel(4, axis="batch"), TensorParallel(2))
    batches = make_batches(3)
    trainer = Trainer(TutorialNet, optax.adam(1e-2), strategy=strategy, loss_fn=classification_loss)
    assert model_specs(trainer.plan) == TUTORIAL_SPECS
    trainer.fit(batches, max_steps=3)
    params, _ = train_reference(TutorialNet, optax.adam(1e-2), batches)
    assert_params_match(trainer, params)
    live = {
        "/".join(map(str, path)): v.get_value().sharding.spec
        for path, v in nnx.to_flat_state(nnx.state(trainer.model, nnx.Param))
    }
    assert live == TUTORIAL_SPECS
    # The optimizer's moments follow their parameter's annotation.
    mu = nnx.to_flat_state(nnx.state(trainer.optimizer, nnx.OptState))
    moments = {
        "/".join(map(str, path)): v.get_value().sharding.spec
        for path, v in mu
        if v.get_value().ndim
    }
    assert moments and all(
        spec == TUTORIAL_SPECS[key.split("/mu/")[-1].split("/nu/")[-1]]
        for key, spec in moments.items()
    ), moments


def test_an_axis_the_trainers_mesh_lacks_is_replicated_as_for_any_annotation():
    plan = Plan(TutorialNet, optax.sgd(0.1), strategy=DataParallel())  # mesh {"data": 8}
    assert set(model_specs(plan).values()) == {P()}
    batch_axis = Plan(
        TutorialNet, optax.sgd(0.1), strategy=Hybrid(DataParallel(4), TensorParallel(2))
    )
    assert model_specs(batch_axis) == TUTORIAL_SPECS  # "batch" is absent; "model" is there


class WronglyAnnotated(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, annotation: object = 3) -> None:
        self.l1 = nnx.Linear(
            16, 32, kernel_init=nnx.with_metadata(LECUN, out_sharding=annotation), rngs=rngs
        )
        self.l2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(self.l1(x))


@pytest.mark.parametrize(
    "annotation, given",
    [
        (3, "is of type int"),
        ("model", r"is of type str.*\('model',\)"),
        ((None, 2.5), "the entry 2.5"),
    ],
    ids=["int", "bare-str", "float-entry"],
)
@pytest.mark.parametrize(
    "strategy",
    [DataParallel(), Hybrid(DataParallel(4), TensorParallel(2))],
    ids=["dp", "hybrid"],
)
def test_an_annotation_of_a_wrong_type_names_the_parameter(annotation, given, strategy):
    with pytest.raises(ShardingError, match=rf"l1/kernel with shape \(16, 32\).*{given}"):
        Plan(lambda rngs: WronglyAnnotated(rngs, annotation), optax.sgd(0.1), strategy=strategy)


@dataclasses.dataclass(frozen=True)
class Column:
    """An annotation only one strategy below understands: split the output features."""


class ColumnNet(WronglyAnnotated):
    def __init__(self, rngs: nnx.Rngs) -> None:
        super().__init__(rngs, Column())


class ColumnTensorParallel(TensorParallel):
    """Answers the leaves annotated ``Column()`` (parameter and moments alike)."""

    def state_shardings(self, abstract_state, mesh, proposed=None):
        proposed = super().state_shardings(abstract_state, mesh, proposed)

        def answer(sharding, variable):
            if variable.get_metadata().get("out_sharding") == Column():
                return NamedSharding(mesh, P(None, self.axis))
            return sharding

        return jax.tree.map(answer, proposed, abstract_state)


def test_a_hybrid_member_answers_an_annotation_the_joint_resolution_cannot_read():
    seen: list[object] = []

    class Recording(ColumnTensorParallel):
        def state_shardings(self, abstract_state, mesh, proposed=None):
            seen.append(proposed["model"]["l1"]["kernel"])
            return super().state_shardings(abstract_state, mesh, proposed)

    strategy = Hybrid(DataParallel(4, axis="batch"), Recording(2))
    batches = make_batches(2)
    trainer = Trainer(ColumnNet, optax.adam(1e-2), strategy=strategy, loss_fn=classification_loss)
    assert isinstance(seen[0], sh.Unresolved) and "l1/kernel" in str(seen[0].error)
    with pytest.raises(ShardingError, match="l1/kernel"):
        seen[0].spec  # noqa: B018  (read as a sharding, it raises the leaf's error)
    assert model_specs(trainer.plan)["l1/kernel"] == P(None, "model")
    trainer.fit(batches, max_steps=2)
    params, _ = train_reference(ColumnNet, optax.adam(1e-2), batches)
    assert_params_match(trainer, params)
    assert trainer.model.l1.kernel.get_value().sharding.spec == P(None, "model")


def test_an_annotation_no_member_answers_is_raised_naming_the_parameter():
    with pytest.raises(ShardingError, match=r"l1/kernel.*is of type Column") as error:
        Plan(ColumnNet, optax.sgd(0.1), strategy=Hybrid(DataParallel(4), TensorParallel(2)))
    assert any("No member of Hybrid" in note for note in error.value.__notes__)


def test_tutorial_mesh_devices_need_not_be_the_trainers():
    """The NamedSharding's own mesh is only read for its spec: a mesh over other devices
    (here the first four, reversed) still annotates a model trained on all eight."""
    other = Mesh(np.array(jax.devices()[:4][::-1]).reshape(2, 2), ("batch", "model"))

    def factory(rngs: nnx.Rngs) -> nnx.Module:
        module = nnx.Linear(
            16,
            8,
            kernel_init=nnx.with_partitioning(LECUN, NamedSharding(other, P("model"))),
            rngs=rngs,
        )
        return module

    plan = Plan(
        factory, optax.sgd(0.1), strategy=Hybrid(DataParallel(4, axis="batch"), TensorParallel(2))
    )
    assert plan.shardings["model"]["kernel"].spec == P("model")
    assert plan.shardings["model"]["kernel"].mesh == plan.mesh

"""The objective protocol, and the registry of objectives by name.

An objective is what the train step minimises and the eval step reports. Each one is a frozen
dataclass in its own module, registered by name (:func:`register`): its hyper-parameters are
its fields (static, from the run spec: :meth:`Objective.from_run`), and its methods give

* the train state it adds (:meth:`~Objective.init_state`; ``TrainState.objective``, empty for
  the language-model loss): initialised with the state, checkpointed with it, each leaf at a
  parameter's path sharded like that parameter and every other leaf replicated
  (``parallel.sharding.state_shardings``), kept as it was when a step is skipped
  (:meth:`~Objective.keep`);
* what it computes once per step on the global batch before the policy's forward, per row
  (:meth:`~Objective.make_prepare`; DPO: the frozen reference's log-probs); the step splits
  those rows with the batch over micro-batches and data-parallel replicas;
* its loss sums on a micro-batch from the model's token losses (:meth:`~Objective.micro_batch_loss`)
  and each replica's share of the global batch (:meth:`~Objective.scale`);
* its eval metrics (:meth:`~Objective.make_eval`, :meth:`~Objective.evaluate`).

A batch holds only data (tokens, targets, weights, positions, segment ids); nothing of the
objective rides in it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax

Batch = dict  # batch key -> array [rows, seq_len]
# (objective state, batch) -> (per-row inputs of the loss, objective state after the step)
Prepare = Callable[[Any, Batch], tuple[Any, Any]]
# (objective state, batch, token losses [B, L]) -> the eval step's metrics
EvalFn = Callable[[Any, Batch, jax.Array], Any]

_REGISTRY: dict[str, type[Objective]] = {}


@dataclasses.dataclass(frozen=True)
class Objective:
    """A training objective: its loss, the train state it declares, its eval metrics."""

    name: ClassVar[str]  # the registry's key
    loss_keys: ClassVar[tuple[str, ...]] = ("loss",)  # what micro_batch_loss returns
    # Trains (chosen, rejected) row pairs, each whole in a micro-batch and replica (its data
    # formats' ``data_spec.FORMATS`` entry says so too: tests/test_objectives).
    pairs: ClassVar[bool] = False

    @classmethod
    def from_run(cls, run) -> Objective:
        """The objective with the hyper-parameters of ``run`` (a ``spec.RunSpec``)."""
        del run
        return cls()

    def init_state(self, params, fp8, moe_state=None) -> Any:
        """The train state this objective adds, from the initial ``params``, ``fp8`` state and
        MoE router biases (``moe_state``: ``TrainState.moe_state``, None or {} if none)."""
        del params, fp8, moe_state
        return {}

    def keep(self, new, old, ok: jax.Array) -> Any:
        """The objective state after a step: ``new`` where ``ok`` (a finite step), else ``old``."""
        del old, ok
        return new

    def make_prepare(self, model, mesh=None) -> Prepare:
        """``prepare(state, batch) -> (rows, state)``: per-row inputs of the loss computed once
        on the global batch (``rows``: leaves with the batch's rows as leading axis)."""
        del model, mesh
        return lambda state, batch: ({}, state)

    def scale(self, batch: Batch, replicas: int) -> jax.Array | float:
        """Each of ``replicas`` replicas' loss scale, from the global ``batch``."""
        raise NotImplementedError

    def adds_up(self, batch: Batch) -> bool:
        """Whether the micro-batch sums times :meth:`scale` are shares of the global batch's
        loss that only add up (else means: micro-batches average and each of N replicas takes
        1/N)."""
        raise NotImplementedError

    def micro_batch_loss(self, apply: Callable, batch: Batch, rows) -> tuple[dict, Any]:
        """One micro-batch's loss sums (keys: ``loss_keys``) and what ``apply`` returned beside
        its output; ``apply(inputs, **kwargs) -> (output, aux)`` runs the model."""
        raise NotImplementedError

    def make_eval(self, model, mesh=None) -> EvalFn:
        """``metrics(state, batch, losses_BxL)`` of the eval step, from the policy's token CE."""
        raise NotImplementedError

    def evaluate(self, eval_step: Callable, state, batches: Sequence[Batch], sharding) -> dict:
        """The validation metrics (``val_...``) over ``batches``, from ``eval_step``'s."""
        raise NotImplementedError


def register(cls: type[Objective]) -> type[Objective]:
    """Class decorator: make ``cls`` buildable by its ``name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"objective {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def get(name: str) -> type[Objective]:
    """The objective class registered as ``name``."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown objective {name!r}: use one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def names() -> list[str]:
    """The registered objectives' names."""
    return sorted(_REGISTRY)


__all__ = ["Batch", "EvalFn", "Objective", "Prepare", "get", "names", "register"]

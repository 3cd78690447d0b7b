"""The adapter protocol: how a training stack tells the optimizer where each matrix lives.

An adapter only *describes*: given one tensor the optimizer steps, it returns a
:class:`~ds_muon.engine.exchange.layout.ParamBinding` (which logical matrices the tensor holds,
which piece of each this rank has, in which process group).  The engine does the
rest, the same way for every stack.  An adapter never sees the optimizer: what it
may know about a tensor besides the tensor itself is a :class:`BindContext`.

Two facts about the stack shape what the engine may overlap:

* ``applies_in_step``: results must be written inside ``step()``, because the
  stack copies them out right after it (DeepSpeed copies its fp32 partitions into
  the model's parameters); no update may be deferred to the next forward and no
  gather may leave from backward.
* :meth:`StackAdapter.grad_final_at_hook`: a parameter's gradient is final when
  its post-accumulate-grad hook fires (FSDP2: the reduce-scatter ran before it;
  one process: nothing to reduce), so its gather may leave from backward.  Under
  DDP, FSDP1 and DeepSpeed the gradient is reduced after that hook.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from ..engine.exchange.layout import ParamBinding

HOW_TO_BIND = (
    "build the engine with ds_muon.deepspeed.initialize(model=..., config=...) (config entry "
    '"optimizer": {"type": "DsMuon", ...}), or call ds_muon.deepspeed.bind(engine) right '
    "after deepspeed.initialize(...) / accelerator.prepare(...) (pass the engine, i.e. the prepared model; "
    "ds_muon.accelerate.prepare and ds_muon.trainer.MuonTrainer do it for you); under PyTorch Lightning use "
    "strategy=ds_muon.lightning.DeepSpeedStrategy(...) (Fabric: ds_muon.lightning.FabricDeepSpeedStrategy) in place "
    'of "deepspeed"'
)
FLAT_PARTITION = "_ds_muon_flat"  # on a stack's 1-D flat partitions that hold matrices (DeepSpeed's, once bound)


@dataclass(frozen=True)
class BindContext:
    """What an adapter may know about a tensor besides the tensor itself.

    ``process_group``: the group the optimizer plans in (None: the world);
    ``model``: the wrapped model where a stack needs it (FSDP1 ``use_orig_params=True``);
    ``options``: the tensor's param group, read for ``head_names`` and ``routers``
    (FSDP1 flat parameters apply the Muon rules per original tensor).
    """

    process_group: Optional[dist.ProcessGroup] = None
    model: Optional[nn.Module] = None
    options: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class StackAdapter(Protocol):
    """Describes the tensors of one training stack; chosen when the optimizer is built
    (``Muon(..., adapter=)``) or attached once after (``Muon.attach``, DeepSpeed)."""

    applies_in_step: bool
    """Results must be applied inside ``step()`` (the stack copies them out right after)."""

    data_parallel_group: Optional[dist.ProcessGroup]
    """The group the stack's data parallelism spans: the optimizer plans in it when it was
    given no ``process_group`` (None: keep the optimizer's)."""

    def bind(self, param: torch.Tensor, name: str, context: BindContext) -> ParamBinding:
        """Where the matrices of ``param`` (named ``name`` in errors and plans) live."""
        ...

    def grad_final_at_hook(self, param: torch.Tensor, context: BindContext) -> bool:
        """Is ``param``'s gradient final when its post-accumulate-grad hook fires?"""
        ...

    # Optional (read with getattr, so not part of the protocol's runtime check):
    # ``check_loaded(groups, state_dict, name, model)``: raise ValueError naming the tensor when a state dict
    # given to ``Muon.load_state_dict`` is one the stack's own save corrupted; called before anything loads.
    # ``place_grads(items, name)``: lay each gradient out like its parameter (FSDP2 DTensors) or raise naming
    # it; called at the start of every step, before the agreement reads the gradients.


def single_process(group: Optional[dist.ProcessGroup]) -> bool:
    """Does ``group`` (None: the world) hold one rank, so that no gradient is reduced?"""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_world_size(group) == 1

"""One model's evidence, gathered once, and one tensor as the rules read it.

:class:`Rules` reads the model through each evidence module (:mod:`.module_types`, :mod:`.config`,
:mod:`.trace`) with the options of :func:`ds_muon.muon_param_groups`; :class:`TensorView` is one tensor's view of
it (its module, shape, tags, traced use, the config's blocks).  Nothing here decides: :mod:`.decide` does.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

from torch import nn

from ..tensors.tag_keys import BLOCKS, EXPERTS, SPLIT_ROWS, TENSOR_PARALLEL
from .blocks import config_plan
from .config import ConfigFacts
from .fused import FusedPlan
from .kinds import Decision
from .meta import try_meta_copy
from .module_types import (STACK_NAMES, ModuleFacts, is_conv, is_conv1d_transformers, is_fused_experts, is_linear,
                           is_router, unwrap_model)
from .names import HEAD_NAMES, clean_name
from .trace import Trace, Use, trace_meta


class TensorView:
    """One tensor as the rules read it: its module, name in the module, shape, the tensor itself (for its
    tags; None under FSDP1 ``use_orig_params=False``) and what the traced forward did with it."""

    def __init__(self, facts: "Rules", module_name: str, module: nn.Module, pname: str, shape, param, use):
        self.facts, self.module_name, self.module, self.pname = facts, module_name, module, pname
        self.shape = tuple(int(s) for s in shape)
        self.param, self.use = param, use
        self.seen = use if len(self.shape) >= 2 else None  # a vector's shape decides: the trace adds nothing
        self.tagged = param is not None and any(getattr(param, a, None) for a in (EXPERTS, SPLIT_ROWS, BLOCKS,
                                                                                  TENSOR_PARALLEL))
        self._plan: Tuple[Optional[FusedPlan]] = ()
        self.plan_error: Optional[NotImplementedError] = None  # the config's blocks cannot be read (raised later)

    def confirmed(self, d: Decision) -> Decision:
        """A decision the traced forward confirms (it used the tensor): its evidence is the trace."""
        return replace(d, decided_by="trace") if self.seen is not None else d

    @property
    def weight(self) -> bool:
        return self.pname == "weight"

    def plan(self) -> Optional[FusedPlan]:
        """The config's fused plan of this tensor (read once)."""
        if not self._plan:
            try:
                self._plan = (config_plan(self.facts, self.module, self.pname, self.shape, self.param),)
            except NotImplementedError as e:  # raised by the module-type rule, where the blocks are needed
                self._plan, self.plan_error = (None,), e
        return self._plan[0]

    def router(self) -> Optional[str]:
        """The evidence that it is a router's weight: ``"module type"`` (a ``*Router``, a gate beside the
        experts) or ``"config"`` (a Linear whose outputs equal the expert count); None."""
        if is_router(self.module):
            return "module type"
        if isinstance(self.module, nn.Linear) and self.weight and self.shape[0] in self.facts.configs.experts:
            return "config"
        return None

    def input_width(self) -> Optional[int]:
        """The input channels of a linear or conv weight that reads the config's raw input width (None)."""
        widths = self.facts.configs.widths
        if is_linear(self.module) and self.weight:
            ins = int(self.shape[0] if is_conv1d_transformers(self.module) else self.shape[1])
        elif is_conv(self.module) and self.weight:
            ins = int(self.module.in_channels)
        else:
            return None
        return ins if ins in widths and ins <= 4 else None

    def matrix_type(self) -> bool:
        """Its module applies it as a matrix (a linear, conv, recurrent, fused or attention projection, a
        router), or the user tagged it."""
        m = self.module
        return ((is_linear(m) or is_conv(m)) and self.weight or isinstance(m, nn.RNNBase)
                and self.pname.startswith("weight_") or self.plan() is not None
                or is_fused_experts(m) and self.pname in STACK_NAMES
                or isinstance(m, nn.MultiheadAttention) and self.pname.endswith("proj_weight")
                or self.tagged or self.router() is not None)


class Rules:
    """One model's evidence (module types, config, the traced forward) and the options it is read with."""

    def __init__(self, model: nn.Module, head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw",
                 split_fused: bool = True, split_attention: Optional[str] = None, trace=True, example_inputs=None):
        model = unwrap_model(model)
        self.head_names = tuple(head_names)
        self.routers, self.split_fused, self.split_attention = routers, split_fused, split_attention
        self.modules = ModuleFacts(model)
        self.configs = ConfigFacts(getattr(model, "config", None))
        self.names_given = self.head_names != HEAD_NAMES
        self.names_rule = not self.modules.pretrained or self.names_given
        if isinstance(trace, Trace):
            self.trace = trace
        elif trace:  # the forward, read on the model's meta copy (made here: the model is never touched)
            shadow, error = try_meta_copy(model)
            self.trace = trace_meta(shadow, example_inputs, error)
        else:
            self.trace = Trace(error="trace=False")
        self.uses = {clean_name(n): u for n, u in self.trace.uses.items()}
        self.disagreements: List[str] = []  # a fused plan of the rules the forward does not split alike
        for m in model.modules():  # so the FSDP1 adapter, seeing one module, asks the same rules
            _RULES_OF[m] = self

    def use_of(self, module: nn.Module, pname: str) -> Optional[Use]:
        """What the traced forward did with ``module``'s ``pname`` (None: not traced, or not used)."""
        path = self.modules.path.get(id(module))
        if path is None or not self.uses:
            return None
        return self.uses.get(clean_name(f"{path}.{pname}" if path else pname))

    def untraced_why(self) -> str:
        return self.trace.error or "not used by the traced forward"


_RULES_OF: "weakref.WeakKeyDictionary[nn.Module, Rules]" = weakref.WeakKeyDictionary()


def rules_of(module: nn.Module, head_names: Sequence[str] = HEAD_NAMES, routers: str = "adamw") -> Rules:
    """The rules last built over a model containing ``module`` (FSDP1 binds one flat parameter at a time, long
    after :func:`ds_muon.muon_param_groups` read the whole model); rules of ``module`` alone when none was
    built, or with other options."""
    rules = _RULES_OF.get(module)
    if rules is not None and rules.head_names == tuple(head_names) and rules.routers == routers:
        return rules
    return Rules(module, head_names, routers, trace=False)  # a module alone: its input is not the model's

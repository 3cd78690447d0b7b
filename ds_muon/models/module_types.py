"""Module types, the first evidence: what each module is, and so how it holds each of its tensors.

Reports only: which modules are linear maps (``nn.Linear`` and subclasses, transformers' ``Conv1D`` stored
``[in, out]``), convolutions (depthwise ones apart), embeddings, recurrent layers, torch's parametrizations,
transformers' fused expert modules and the routers beside them, PEFT's adapters (a LoRA factor stands for
its base layer; a ``modules_to_save`` copy for the module it copies), the module behind a wrapper (DDP,
``torch.compile``, PEFT, DeepSpeed's engine), and the model's own API for its ends
(``get_input_embeddings()``, ``get_output_embeddings()``, ``base_model``).  :mod:`.decide` reads it with the
other evidence.

PEFT is read from its types (``LoraLayer``, ``ModulesToSaveWrapper``) where peft is loaded, else from the same
structure (``base_layer`` beside ``lora_A``; ``original_module`` beside ``modules_to_save``).
"""

from __future__ import annotations

import sys
from typing import Dict, Optional, Set, Tuple

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd

EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)
RECURRENT_GATES = {"LSTM": "ifgo", "GRU": "rzn"}  # nn.LSTM / nn.GRU weights stack one matrix per gate

EXPERTS_FLAGS = ("is_concatenated", "is_transposed", "has_gate")  # set by @use_experts_implementation
STACK_NAMES = ("gate_up_proj", "up_proj", "down_proj")
ROUTER_MARK = "_ds_muon_router"  # on gate-named siblings of an experts module (and their submodules)
GATE_NAMES = ("gate", "router")


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers experts module (``@use_experts_implementation``) holding fused stacks."""
    return all(hasattr(module, f) for f in EXPERTS_FLAGS) and any(
        isinstance(getattr(module, n, None), torch.Tensor) or n in getattr(module, "_parameters", {})
        for n in STACK_NAMES)


def is_router(module: nn.Module) -> bool:
    """A MoE router: a ``*Router`` module, or one :func:`mark_routers` found beside the experts."""
    return "Router" in type(module).__name__ or bool(getattr(module, ROUTER_MARK, False))


def _gate_named(child_name: str) -> bool:
    return any(child_name == g or child_name.endswith("_" + g) for g in GATE_NAMES)


def mark_routers(model: nn.Module) -> None:
    """Mark gate-named siblings of every experts module as routers (the module tree survives
    FSDP1 wrapping, so adapters that see only modules read the same mark)."""
    for parent in model.modules():
        children = dict(parent.named_children())
        if not any(is_fused_experts(c) for c in children.values()):
            continue
        for child_name, child in children.items():
            if _gate_named(child_name) and not is_fused_experts(child):
                for m in child.modules():
                    setattr(m, ROUTER_MARK, True)


def is_conv1d_transformers(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2 and kin): a linear layer stored ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d_transformers(module)


def is_conv(module: nn.Module) -> bool:
    return isinstance(module, _ConvNd)


def is_depthwise(module: nn.Module) -> bool:
    return isinstance(module, _ConvNd) and module.groups > 1 and module.groups == module.in_channels


def is_attention(module: nn.Module) -> bool:
    return hasattr(module, "head_dim") or "Attention" in type(module).__name__


def stores_in_out(module: nn.Module, pname: str) -> bool:
    """transformers' ``Conv1D`` (GPT-2) stores its weight ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and pname == "weight"


def subtree_ids(module: Optional[nn.Module]) -> Set[int]:
    return {id(m) for m in module.modules()} if isinstance(module, nn.Module) else set()


class ModuleFacts:
    """The module tree of one model as its types describe it: paths, parents, tensors tied to an embedding,
    PEFT's factors and saved copies, the model's ends by its own API; routers beside fused experts are marked
    on the modules."""

    def __init__(self, model: nn.Module):
        self.parent: Dict[int, Tuple[nn.Module, str]] = {}
        self.path: Dict[int, str] = {}
        for name, m in model.named_modules():
            self.path[id(m)] = name
            for cname, c in m.named_children():
                self.parent.setdefault(id(c), (m, cname))
        self.embedding_params: Set[int] = set()
        for m in model.modules():
            if isinstance(m, EMBEDDING_TYPES):
                self.embedding_params.update(id(p) for p in m.parameters(recurse=False))
        self.lora_factors = lora_factors(model)  # PEFT: a factor takes its base layer's decision
        self.saved_copies = saved_copies(model)  # PEFT: a modules_to_save copy, the original's
        mark_routers(model)
        # the model's own API for its ends (transformers' PreTrainedModel; any model with get_output_embeddings)
        self.pretrained = (hasattr(model, "get_input_embeddings") and hasattr(model, "base_model")
                           and hasattr(model, "config"))
        self.input_ids = subtree_ids(_call(model, "get_input_embeddings")) if self.pretrained else set()
        out = _call(model, "get_output_embeddings")
        self.output_ids = subtree_ids(out) if self.pretrained or hasattr(model, "get_output_embeddings") else set()
        base = getattr(model, "base_model", model) if self.pretrained else model
        self.head_region = (subtree_ids(model) - subtree_ids(base)) if base is not model else set()

    def parametrized(self, module: nn.Module) -> Optional[Tuple[nn.Module, str]]:
        """``(layer, tensor name)`` when ``module`` is a ``ParametrizationList`` of ``layer``."""
        if type(module).__name__ != "ParametrizationList" or id(module) not in self.parent:
            return None
        holder, name = self.parent[id(module)]
        if id(holder) not in self.parent:
            return None
        return self.parent[id(holder)][0], name


def _call(model, name):
    try:
        return getattr(model, name)()
    except (NotImplementedError, AttributeError, TypeError, ValueError):
        return None


# -- PEFT's adapters ---------------------------------------------------------------------------------
FACTOR_DICTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def _peft_types():
    """``(LoraLayer, ModulesToSaveWrapper)`` when peft is loaded (a PEFT model means it is), else Nones."""
    if "peft" not in sys.modules:
        return None, None
    try:
        from peft.tuners.lora import LoraLayer
        from peft.utils import ModulesToSaveWrapper
    except ImportError:  # another peft layout: the structural fallback below
        return None, None
    return LoraLayer, ModulesToSaveWrapper


def is_lora_layer(module: nn.Module) -> bool:
    lora, _ = _peft_types()
    if lora is not None and isinstance(module, lora):
        return True
    return isinstance(getattr(module, "base_layer", None), nn.Module) and isinstance(
        getattr(module, "lora_A", None), (nn.ModuleDict, nn.ParameterDict))


def is_modules_to_save(module: nn.Module) -> bool:
    _, wrapper = _peft_types()
    if wrapper is not None and isinstance(module, wrapper):
        return True
    return isinstance(getattr(module, "original_module", None), nn.Module) and isinstance(
        getattr(module, "modules_to_save", None), nn.ModuleDict)


def base_layer_of(layer: nn.Module) -> nn.Module:
    """The layer a LoRA layer adapts (through nested adapters: PEFT's ``get_base_layer()``)."""
    get = getattr(layer, "get_base_layer", None)
    if callable(get):
        return get()
    while isinstance(getattr(layer, "base_layer", None), nn.Module):
        layer = layer.base_layer
    return layer


def lora_factors(model: nn.Module) -> Dict[int, Tuple[nn.Module, str]]:
    """``id(module holding a factor) -> (its LoRA layer, which factor)``: each adapter's ``lora_A``/``lora_B``
    module, and the ``ParameterDict`` of ``lora_embedding_A``/``_B`` (whose tensors it holds itself)."""
    out: Dict[int, Tuple[nn.Module, str]] = {}
    for m in model.modules():
        if not is_lora_layer(m):
            continue
        for which in FACTOR_DICTS:
            holder = getattr(m, which, None)
            if isinstance(holder, nn.ParameterDict):
                out[id(holder)] = (m, which)
            elif isinstance(holder, nn.ModuleDict):
                for factor in holder.values():
                    for sub in factor.modules():
                        out[id(sub)] = (m, which)
    return out


def saved_copies(model: nn.Module) -> Dict[int, nn.Module]:
    """``id(module inside a modules_to_save copy) -> the module of the original it copies``."""
    out: Dict[int, nn.Module] = {}
    for m in model.modules():
        if not is_modules_to_save(m):
            continue
        for copy in m.modules_to_save.values():
            for rel, sub in copy.named_modules():
                try:
                    out[id(sub)] = m.original_module.get_submodule(rel) if rel else m.original_module
                except AttributeError:
                    continue
    return out


# -- the module behind a wrapper ------------------------------------------------------------------
_MAX_DEPTH = 6


# what each wrapper keeps its module under: DDP / DataParallel / DeepSpeed's engine / FSDP1's root
# (``module``), torch.compile's OptimizedModule (``_orig_mod``), PEFT's PeftModel (``base_model.model``
# through ``get_base_model()``)
_MODULE_WRAPPERS = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine", "PipelineEngine",
                    "FullyShardedDataParallel", "OptimizedModule", "PeftModel", "PeftModelForCausalLM",
                    "PeftModelForSequenceClassification", "PeftModelForSeq2SeqLM", "PeftModelForTokenClassification",
                    "PeftModelForQuestionAnswering", "PeftModelForFeatureExtraction", "PeftMixedModel")


def _is_peft_model(model) -> bool:
    """PEFT's ``PeftModel``/``PeftMixedModel`` by type when peft is loaded; by name otherwise."""
    peft = sys.modules.get("peft")
    types = tuple(t for t in (getattr(peft, "PeftModel", None), getattr(peft, "PeftMixedModel", None))
                  if isinstance(t, type))
    if types and isinstance(model, types):
        return True
    name = type(model).__name__
    return name.startswith("PeftModel") or name == "PeftMixedModel"


def unwrap_model(model):
    """The user's module behind DDP, DataParallel, DeepSpeed's engine, an FSDP1 root, ``torch.compile`` and
    PEFT (FSDP2's ``fully_shard`` and accelerate keep the module itself, or wrap it in one of these), so what
    is decided about a model cannot depend on how it is wrapped.  Parameters are the same objects."""
    for _ in range(_MAX_DEPTH):
        name = type(model).__name__
        inner = None
        if name == "OptimizedModule":
            inner = getattr(model, "_orig_mod", None)
        elif _is_peft_model(model):
            get = getattr(model, "get_base_model", None)
            inner = get() if callable(get) else None
        elif name in _MODULE_WRAPPERS:
            inner = getattr(model, "module", None)
        if inner is None or inner is model:
            return model
        model = inner
    return model

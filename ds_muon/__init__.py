"""ds_muon: Muon for sharded PyTorch training (DeepSpeed ZeRO, FSDP1/FSDP2, DDP, accelerate)."""

from .engine import moved

moved.install()  # old module paths, one release more (ds_muon.engine.moved)

from .engine.exchange.layout import Layout, MatrixSlot, ParamBinding, Piece
from .engine.plan.cost_model import CostModel, MatrixTask, Plan
from .engine.plan.planner import plan_homes
from .models.tags import domain, expert_weight, fused_blocks, row_axes, split_rows, tensor_parallel, transposed
from .optimizer import Muon
from .param_groups import muon_param_groups
from .qk_clip import QKClip
from .rules.newton_schulz import newton_schulz
from .rules.scaling import get_muon_scale_factor
from .unwrap import find_muon

__all__ = [
    "Muon", "QKClip", "muon_param_groups", "newton_schulz", "get_muon_scale_factor",
    "Layout", "MatrixSlot", "ParamBinding", "Piece", "CostModel", "MatrixTask", "Plan", "plan_homes",
    "split_rows", "tensor_parallel", "expert_weight", "domain", "transposed", "fused_blocks", "row_axes",
    "find_muon",
]
__version__ = "0.1.0"


def __getattr__(name):
    # ``ds_muon.deepspeed`` / ``.accelerate`` / ``.trainer`` without importing those libraries for users who do
    # not use them
    if name in ("deepspeed", "accelerate", "trainer", "lightning", "torchtitan", "peft"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ds_muon' has no attribute {name!r}")

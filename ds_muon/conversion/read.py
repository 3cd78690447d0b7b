"""Each source format read as :class:`~ds_muon.conversion.named.Named`: DeepSpeed ZeRO (through DeepSpeed's
universal conversion), universal, DCP (through ``dcp_to_torch_save``), torch files and live optimizers."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..integrations.safe_load import UnreadableCheckpoint, load, loads_pickle, trusted
from .named import Named

FORMATS = ("auto", "deepspeed", "universal", "dcp", "torch")


def detect_format(src) -> str:
    if isinstance(src, dict):
        return "torch"
    src = os.fspath(src)
    if os.path.isfile(src):
        return "torch"
    if os.path.isfile(os.path.join(src, ".metadata")):
        return "dcp"
    if os.path.isdir(os.path.join(src, "zero")):
        return "universal"
    if any(f.endswith("_optim_states.pt") for f in os.listdir(src)):
        return "deepspeed"
    for latest in ("latest", "latest_universal"):
        path = os.path.join(src, latest)
        if os.path.isfile(path):
            with open(path) as f:
                return detect_format(os.path.join(src, f.read().strip()))
    raise ValueError(f"ds_muon.convert: cannot tell what {src} is (a torch file, a DCP folder with .metadata, a "
                     "DeepSpeed checkpoint folder with *_optim_states.pt or a latest file, or a universal one with "
                     "zero/); pass source= (ds-muon convert --source)")


def _tag_folder(src: str) -> str:
    if any(f.endswith("_optim_states.pt") for f in os.listdir(src)) or os.path.isdir(os.path.join(src, "zero")):
        return src
    for latest in ("latest", "latest_universal"):
        if os.path.isfile(os.path.join(src, latest)):
            with open(os.path.join(src, latest)) as f:
                return os.path.join(src, f.read().strip())
    return src


def _not_a(folder: str, what: str, has: str) -> ValueError:
    return ValueError(f"ds_muon.convert: {folder} is no {what} (it has no {has}); give the folder of one, or pass the "
                      "source= it is (ds-muon convert --source; auto tells them apart)")


def read_universal_named(folder: str) -> Named:
    from ..integrations.deepspeed_universal import read_universal

    if not os.path.isdir(os.path.join(folder, "zero")):
        raise _not_a(folder, "DeepSpeed universal checkpoint", "zero/ folder")

    named = Named()
    for name, entries in read_universal(folder).items():
        named.weights[name] = entries.pop("fp32")
        if entries:
            named.state[name] = entries
    return named


def read_deepspeed(folder: str) -> Named:
    """A ZeRO-1/2/3 checkpoint folder (one tag, or its root with ``latest``) by tensor name."""
    from ..integrations.deepspeed_universal import zero_to_universal

    tag = _tag_folder(folder)
    if not os.path.isdir(tag) or not any(f.endswith("_optim_states.pt") for f in os.listdir(tag)):
        raise _not_a(folder, "DeepSpeed ZeRO checkpoint", "*_optim_states.pt files, nor a latest file naming a tag "
                     "folder with them")
    with tempfile.TemporaryDirectory() as tmp:
        return read_universal_named(zero_to_universal(tag, os.path.join(tmp, "universal")))


def _is_optimizer_sd(v) -> bool:
    return isinstance(v, dict) and "state" in v and "param_groups" in v


def _optimizer_state_dicts(obj) -> List[dict]:
    if _is_optimizer_sd(obj):
        return [obj]
    if isinstance(obj, dict):
        return [sd for v in obj.values() for sd in _optimizer_state_dicts(v)]
    if isinstance(obj, (list, tuple)):
        return [sd for v in obj for sd in _optimizer_state_dicts(v)]
    return []


def _model_state_dict(obj: dict) -> Dict[str, torch.Tensor]:
    for key in ("model", "module", "state_dict", "model_state_dict"):
        v = obj.get(key)
        if isinstance(v, dict) and v and all(torch.is_tensor(t) for t in v.values()):
            return v
    return {}


def named_state(optimizers, model: Optional[nn.Module] = None,
                param_names: Optional[Sequence[Sequence[str]]] = None) -> Dict[str, Dict[str, Any]]:
    """Per-tensor state by name from torch optimizers (live, with ``model``) or their state dicts.

    A state dict names its tensors by FQN-keyed state (DCP's full state dicts), by ``param_names`` in its
    groups, or by ``param_names`` given here (one list per group, over all optimizers in order)."""
    if not isinstance(optimizers, (list, tuple)):
        optimizers = [optimizers]
    out: Dict[str, Dict[str, Any]] = {}
    given = list(param_names) if param_names is not None else None
    for opt in optimizers:
        if isinstance(opt, torch.optim.Optimizer):
            if model is None:
                raise ValueError("ds_muon.convert.named_state: live optimizers need model= to name their tensors")
            names = {id(p): n for n, p in model.named_parameters()}
            for g in opt.param_groups:
                for p in g["params"]:
                    if id(p) not in names:
                        raise ValueError(f"ds_muon.convert: {type(opt).__name__} steps a tensor of shape "
                                         f"{tuple(p.shape)} that is not a parameter of the model given")
                    if opt.state.get(p):
                        out[names[id(p)]] = dict(opt.state[p])
            continue
        if not _is_optimizer_sd(opt):
            raise ValueError(f"ds_muon.convert: expected an optimizer or its state_dict(), got {type(opt).__name__}")
        state = opt["state"]
        if state and all(isinstance(k, str) for k in state):  # FQN-keyed (DCP full state dict)
            out.update({k: dict(v) for k, v in state.items()})
            continue
        for gi, g in enumerate(opt["param_groups"]):
            names = g.get("param_names")
            if names is None and given:
                names = given.pop(0)
            if names is None or len(names) != len(g["params"]):
                raise ValueError(
                    f"ds_muon.convert: param group {gi} of a {len(opt['param_groups'])}-group optimizer state dict "
                    f"does not name its {len(g['params'])} tensors; build the optimizer from model.named_parameters() "
                    "(torch records param_names then), pass the live optimizer with model=, or pass param_names=")
            for idx, name in zip(g["params"], names):
                if idx in state:
                    out[name] = dict(state[idx])
    return out


def read_torch(obj, param_names=None) -> Named:
    """A torch file (or the dict in it): the model's state dict and the optimizer state dicts beside it."""
    if not isinstance(obj, dict):
        if os.path.isdir(obj):
            raise ValueError(f"ds_muon.convert: {os.fspath(obj)} is a folder, not a torch file; give the file "
                             "torch.save wrote, or pass the source= the folder is (--source; auto tells them apart)")
        obj = load(os.fspath(obj))
    sds = _optimizer_state_dicts(obj)
    if not sds:
        raise ValueError("ds_muon.convert: found no optimizer state dict (a dict with 'state' and 'param_groups') in "
                         f"the source (top-level keys: {sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__}"
                         "); give a file saved with the optimizers' state_dict()")
    return Named(weights=dict(_model_state_dict(obj)), state=named_state(sds, param_names=param_names))


def read_dcp(folder: str) -> Named:
    """A DCP checkpoint, any world size: DCP's own ``dcp_to_torch_save`` (kept in memory), then :func:`read_torch`;
    its ``.metadata`` and non-tensor items (which DCP unpickles fully) read as data only (:mod:`..integrations.safe_load`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            path = self._get_metadata_path(kwargs.get("rank"))
            with open(path, "rb") as f:
                metadata = loads_pickle(f.read(), os.fspath(path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value):
            fqn = read_item.dest_index.fqn
            obj = load(value, name=f"{folder} (item {fqn})")
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    from torch.distributed.checkpoint.api import CheckpointException

    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise _not_a(folder, "DCP checkpoint", ".metadata")
    Reader(folder).read_metadata()  # refused here, by name, rather than inside DCP's gathered exception
    sd: Dict[str, Any] = {}
    try:
        _load_state_dict(sd, storage_reader=Reader(folder), planner=Planner(), no_dist=True)  # as dcp_to_torch_save
    except CheckpointException as e:
        causes = [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]
        ours = next((c for c in causes if isinstance(c, ValueError) and str(c).startswith("ds_muon")), None)
        if ours is not None:
            raise ours from None
        why = " ".join(str(causes[0] if causes else e).split())[:160]
        raise UnreadableCheckpoint(f"ds_muon: cannot read the DCP checkpoint {folder} ({why}); copy it again from "
                                   "where it was saved (every .distcp file and .metadata)") from None
    return read_torch(sd)


def read(src, source: str = "auto", param_names=None, trust_checkpoint: bool = False) -> Named:
    """Any source format as :class:`Named`; every file read as data only unless ``trust_checkpoint``
    (:mod:`ds_muon.integrations.safe_load`)."""
    if source not in FORMATS:
        raise ValueError(f"ds_muon.convert: source={source!r} is unknown; use one of {list(FORMATS)}")
    kind = detect_format(src) if source == "auto" else source
    with trusted(trust_checkpoint):
        if kind == "torch":
            return read_torch(src, param_names)
        return {"deepspeed": read_deepspeed, "universal": read_universal_named, "dcp": read_dcp}[kind](os.fspath(src))

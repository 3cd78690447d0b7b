"""What a copy of the optimizer (``copy.deepcopy``, pickle) carries, what it must be given again, and
how groups of an older ds_muon state dict are brought up to date on load.

A copy carries torch's ``defaults``, ``state`` and ``param_groups`` plus :data:`SETTINGS`; never the
model, the process group, QK-clip or a chosen adapter (a DeepSpeed binding), nor the step's caches and
hooks (:class:`~ds_muon.engine.runtime.StepRuntime`, rebuilt at the first step).  A copy that lost one it
cannot step without refuses to step (:func:`check_not_carried`) until it is given one again.  A copy
of one built with ``model=`` steps without overlap hooks (same results); FSDP1 ``use_orig_params=True``
needs ``copy.model = fsdp_model``.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .agreement.settings import drop_old_defaults, fill_group_defaults, ns_dtype_name
from .overlap import OverlapSettings

SETTINGS = ("mode", "overlap_settings", "nonfinite", "comm_dtype", "planner", "team_ns",
            "cost_model", "adam_betas", "adam_eps", "nonfinite_skips", "log_summary")
NOT_CARRIED = ("model", "process_group", "qk_clip")


def carried(opt) -> dict:
    """The ds_muon settings a copy of ``opt`` carries, with the names of what it lost (``_not_carried``)."""
    out = {k: getattr(opt, k) for k in SETTINGS}
    out["_not_carried"] = tuple(k for k in NOT_CARRIED if getattr(opt, k, None) is not None) + (
        ("adapter",) if opt._adapter_chosen else ()) + tuple(opt._not_carried)
    return out


def restored(settings: dict) -> Tuple[dict, Tuple[str, ...]]:
    """``(settings, lost)`` from what :func:`carried` wrote (an older pickle's overlap keys read too);
    the model is not among what must be given again (a copy steps without overlap hooks)."""
    settings = dict(settings)
    lost = settings.pop("_not_carried")
    if "overlap" in settings:  # pickled before OverlapSettings
        settings["overlap_settings"] = OverlapSettings(
            settings.pop("overlap"), settings.pop("waves"), settings.pop("dispatch_in_backward"))
    return settings, tuple(sorted(set(lost) - {"model"}))


def check_not_carried(opt, how_to_bind: str) -> None:
    """A copy that lost a process group, QK-clip or a stack binding refuses to step."""
    lost = opt._not_carried
    if "adapter" in lost and not opt._adapter_chosen:
        raise RuntimeError(
            "ds_muon: this Muon is a copy (copy.deepcopy / pickle) of one bound to a DeepSpeed engine; "
            "bindings are not copied and stepping it unbound would orthogonalize the wrong thing. "
            "Bind the copy to the engine that steps it: " + how_to_bind)
    if "qk_clip" in lost and opt.qk_clip is None:
        raise RuntimeError(
            "ds_muon: this Muon is a copy (copy.deepcopy / pickle) of one built with qk_clip; the clip holds the "
            "model and is not copied: set copy.qk_clip = ds_muon.QKClip(model, tau=..., alpha=...)")
    if "process_group" in lost and opt.process_group is None:
        raise RuntimeError(
            "ds_muon: this Muon is a copy (copy.deepcopy / pickle) of one built with a process_group; "
            "process groups are not copied: set copy.process_group to the group it should plan in")


def upgrade_groups(param_groups, state, defaults: dict, adam_betas, adam_eps) -> None:
    """Fill what older ds_muon state dicts lack, as torch's optimizers do on load: missing group
    keys from the defaults, dtypes by name, and an AdamW ``step`` stored as a plain number as a
    float32 tensor."""
    for group in param_groups:
        fill_group_defaults(group, defaults, adam_betas, adam_eps)
        drop_old_defaults(group, defaults)  # an older ds_muon filled Muon's defaults into AdamW groups
        if "ns_dtype" in group:
            group["ns_dtype"] = ns_dtype_name(group["ns_dtype"])  # older ones stored a torch.dtype
        for p in group["params"]:
            st = state.get(p)
            if st and "step" in st and not torch.is_tensor(st["step"]):
                st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)

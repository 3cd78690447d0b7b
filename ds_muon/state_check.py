"""A loaded optimizer state dict must fit the tensors it is loaded into: same shapes, tensor by tensor.

torch's ``Optimizer.load_state_dict`` checks only that the groups have as many tensors; a state dict of
another model with the same group sizes (or names) loads without a word and leaves momentum and AdamW
moments of other shapes on the tensors, which break or silently broadcast at the next step.
:func:`check_state_shapes` names the first tensor whose saved state does not fit, before anything changes
(every rank loads the same state dict, so every rank raises).
"""

from __future__ import annotations

from typing import List

import torch

HINT = ("the state dict is from another model (or another sharding of it); nothing was loaded. To bring "
        "state over from another optimizer, model layout or stack, convert it by tensor name: "
        "ds_muon.convert / `ds-muon convert` (docs/CHECKPOINTS.md)")


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)  # a DTensor's shape is its global shape, like its parameter's


def check_state_shapes(groups: List[dict], saved: dict) -> None:
    state, saved_groups = saved.get("state", {}), saved.get("param_groups", [])
    for gi, (now, old) in enumerate(zip(groups, saved_groups)):
        names = now.get("param_names") or []
        old_names = old.get("param_names") or []
        for k, (p, idx) in enumerate(zip(now["params"], old["params"])):
            for key, v in (state.get(idx) or {}).items():
                if not torch.is_tensor(v) or v.dim() == 0 or _shape(v) == _shape(p) or v.stride() == (0,) * v.dim():
                    continue
                ours = names[k] if k < len(names) else f"tensor {k}"
                theirs = f" (saved as {old_names[k]})" if k < len(old_names) and old_names[k] != ours else ""
                raise ValueError(f"ds_muon: loaded param_groups[{gi}] state {key!r} of {ours}{theirs} has shape "
                                 f"{list(v.shape)} and the tensor is {list(p.shape)}: {HINT}")

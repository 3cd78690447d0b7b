"""Process groups ds_muon creates inherit the timeout of the group they come from.

``dist.new_group`` and DeviceMesh's flattening default to the backend's timeout
(30 minutes for gloo, 10 for NCCL), whatever the job gave ``init_process_group``.  A
peer that raised inside the step (out of memory, say) and stays alive would then
hold every other rank in the exchange's all_to_all for that long, while the job
asked its collectives to fail after, e.g., 15 s.  So every group made here is given
the timeout of the group it is carved from.
"""

from __future__ import annotations

from datetime import timedelta
from typing import List, Optional

import torch.distributed as dist


def timeout_of(group: Optional[dist.ProcessGroup]) -> Optional[timedelta]:
    """The timeout ``group``'s collectives run under (None: the world group), read from its
    backends' options (the longest where several devices have one); None when no backend
    exposes one."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    found: List[timedelta] = []
    for device in getattr(pg, "_device_types", ()):
        try:
            timeout = pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, timedelta):
            found.append(timeout)
    return max(found) if found else None


def new_group_like(ranks: List[int], backend: str, parent: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """``dist.new_group(ranks, backend=backend)`` with ``parent``'s timeout (collective over the world)."""
    return dist.new_group(list(ranks), backend=backend, timeout=timeout_of(parent))


def flattened_group(mesh) -> dist.ProcessGroup:
    """The group of ``mesh`` flattened to one dimension (DeviceMesh caches it).  When DeviceMesh
    has to create it now, it gets the longest timeout of the mesh's own dimension groups (it is
    carved from them); a group that existed before (the world, one made by the user) is left as is."""
    before = set(_all_groups())
    group = mesh._flatten().get_group(0)
    if group in before:
        return group
    wanted = [t for t in (timeout_of(mesh.get_group(d)) for d in range(mesh.ndim)) if t is not None]
    if wanted and timeout_of(group) != max(wanted):
        dist.distributed_c10d._set_pg_timeout(max(wanted), group)
    return group


def _all_groups():
    """Every process group this process knows (torch keeps them in its ``_world``)."""
    return dist.distributed_c10d._world.pg_map.keys()

"""Deprecated: the tags moved to :mod:`ds_muon.tags`, the slot builders to :mod:`ds_muon.slots`.

Kept so that ``from ds_muon.tagging import ...`` keeps working; import from the new
modules (the public tags also from ``ds_muon`` itself).
"""

from .slots import Block, block_slots, logical_blocks, tp_slots  # noqa: F401
from .tags import (  # noqa: F401
    DOMAIN, EXPERTS, SHAPE_TAGS, SPLIT_ROWS, TENSOR_PARALLEL, TRANSPOSED, domain, domain_of, expert_weight, is_tagged,
    is_transposed, restore_tags, shape_tags, split_rows, tensor_parallel, transposed,
)

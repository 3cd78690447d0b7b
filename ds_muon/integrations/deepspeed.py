"""DeepSpeed: where ZeRO put each matrix, read from DeepSpeed's own metadata.

DeepSpeed wraps the client optimizer and replaces the tensors in its
``param_groups`` with flat fp32 partitions (one per param group, or per ZeRO-3
sub-group) before calling ``step()``.  :func:`bind` attaches a :class:`DeepSpeedAdapter` to the
:class:`~ds_muon.Muon` inside an engine; it maps each such partition to a
:class:`~ds_muon.engine.exchange.layout.ParamBinding`:

* ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and ``BF16_Optimizer``: every
  low-precision parameter of the group carries ``_hp_mapping`` (None when the
  rank holds none of it); ``lp_fragment_address.start`` is where this rank's
  fragment starts in the parameter's flattening, ``hp_fragment_address.start``
  where it sits in the flat fp32 partition.
* ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): ``grad_position[param_id] =
  (sub_group, offset, numel)`` places each parameter's ``ds_tensor`` in the
  sub-group's flat fp32 partition; the rank holds elements
  ``[rank·ds_tensor.ds_numel, …)`` of the parameter, whose shape is
  ``ds_shape`` (``p.shape`` is ``(0,)`` outside forward).
* Stage 0 (no ZeRO, fp32): the client optimizer steps the model's own replicated
  parameters; they are bound as replicas over the data-parallel group.

With ``offload_optimizer: {device: cpu}`` the same partitions (and their ``.grad``) live in
host memory and DeepSpeed still steps them through the client optimizer: the metadata read
is the same, and the adapter's ``offload`` tells the engine that the NS work should move to
the accelerator (:mod:`ds_muon.engine.memory.offload`).  NVMe and partial offload are refused.

Nothing here computes offsets of its own: a misdescribed partition would fail
in :func:`~ds_muon.engine.exchange.layout.build_layout`, not corrupt the update.  DeepSpeed copies
the partitions into the model's parameters right after ``step()``, so results are
applied inside it (``applies_in_step``) and no gradient is final before DeepSpeed's
own reduction.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ..engine.exchange.layout import MatrixSlot, ParamBinding, Piece
from ..engine.exchange.slots import block_slots
from ..tensors.tag_keys import TENSOR_PARALLEL, is_tagged, is_transposed
from .base import HOW_TO_BIND, BindContext
from .local import bind_replicated

__all__ = ["DeepSpeedAdapter", "check_supported_config", "allow_client_optimizer_offload", "check_no_deepspeed_muon_tags", "HOW_TO_BIND"]


def _flat_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1)


FP16_STAGE0_MESSAGE = (
    'ds_muon: "fp16": {"enabled": true} at ZeRO stage 0 is not supported: DeepSpeed 0.19.8\'s stage-0 fp16 '
    "wrapper (FP16_UnfusedOptimizer) never scales the loss in engine.backward but still divides the gradients by "
    "the loss scale before the optimizer step, so Muon (and AdamW) would see gradients divided by the scale (and "
    'fp16 gradients underflow unscaled). Use "bf16": {"enabled": true}, or "zero_optimization": {"stage": 1} '
    "(or 2, 3) with fp16")
OFFLOAD_MESSAGE = (
    'ds_muon: "zero_optimization": {{"offload_optimizer": {{"device": "{device}"}}}} is not supported: ds_muon keeps '
    "momentum and AdamW moments beside DeepSpeed's fp32 partition in host memory (\"device\": \"cpu\"), not on "
    'NVMe. Use "offload_optimizer": {{"device": "cpu", "pin_memory": true}}, or "device": "none"')
PARTIAL_OFFLOAD_MESSAGE = (
    'ds_muon: "offload_optimizer": {{"ratio": {ratio}}} is not supported: DeepSpeed steps the sub-groups it keeps '
    "on the accelerator with a second torch AdamW (only with its DeepSpeedCPUAdam), which would skip Muon. "
    'Remove "ratio" (offload everything) or set it to 1.0')


def offload_device(config: dict) -> str:
    """The ``offload_optimizer`` device a DeepSpeed config asks for ("none" when it asks for none)."""
    zero = config.get("zero_optimization") or {}
    device = str((zero.get("offload_optimizer") or {}).get("device", "none")).lower()
    return "none" if device == "auto" else device


def check_supported_config(config: dict) -> None:
    """Refuse DeepSpeed settings ds_muon cannot train correctly, before DeepSpeed builds anything.

    ``offload_optimizer`` to ``"cpu"`` is supported (:func:`allow_client_optimizer_offload`
    lets DeepSpeed take Muon there); NVMe and partial offload are refused.  The adapter
    refuses the same settings from the built wrapper (for engines built elsewhere)."""
    zero = config.get("zero_optimization") or {}
    device = offload_device(config)
    if device not in ("none", "cpu"):
        raise NotImplementedError(OFFLOAD_MESSAGE.format(device=device))
    ratio = (zero.get("offload_optimizer") or {}).get("ratio", 1.0)
    if device == "cpu" and float(ratio) != 1.0:
        raise NotImplementedError(PARTIAL_OFFLOAD_MESSAGE.format(ratio=ratio))
    fp16 = config.get("fp16") or {}
    if fp16.get("enabled") is True and zero.get("stage", 0) in (0, "0"):  # DeepSpeed's default stage is 0
        raise NotImplementedError(FP16_STAGE0_MESSAGE)


def allow_client_optimizer_offload(config: dict) -> dict:
    """``config`` with ``zero_force_ds_cpu_optimizer: false`` when it offloads the optimizer to the
    host: DeepSpeed otherwise refuses any optimizer but its CPU Adam there.  Muon steps the host
    partition itself (exactly as without offload); a user's explicit ``true`` is refused."""
    if offload_device(config) != "cpu":
        return config
    if config.get("zero_force_ds_cpu_optimizer") is True:
        raise ValueError('ds_muon: "zero_force_ds_cpu_optimizer": true forbids any optimizer but DeepSpeed\'s CPU '
                         'Adam under "offload_optimizer"; remove it (ds_muon sets it to false: Muon steps the host '
                         "partition itself)")
    config["zero_force_ds_cpu_optimizer"] = False
    return config


class DeepSpeedAdapter:
    """Maps the tensors DeepSpeed hands to ``Muon.step`` to bindings.

    ``wrapped``: DeepSpeed wrapped the client optimizer in ``engine.optimizer`` (ZeRO,
    BF16_Optimizer, stage-0 fp16/bf16); False when the engine steps the client optimizer
    itself (stage 0, fp32)."""

    applies_in_step = True

    def __init__(self, engine, wrapped: bool = True):
        self.engine = engine
        self.wrapper = engine.optimizer
        self.wrapped = wrapped
        self.names: Dict[torch.Tensor, str] = dict(getattr(engine, "param_names", None) or {})
        self.offload = False  # the fp32 partitions (and so Muon's state) live in host memory
        self.kind, self.flats = self._describe()
        self.data_parallel_group = _dp_group(engine)

    # -- what DeepSpeed built ---------------------------------------------------
    def _describe(self) -> Tuple[str, Dict[int, int]]:
        w = self.wrapper
        if not self.wrapped:
            return "replicated", {}
        if hasattr(w, "fp32_groups") and hasattr(w, "fp16_groups") and not hasattr(w, "fp32_groups_flat"):
            # stage 0 with fp16/bf16 (FP16_UnfusedOptimizer): a full fp32 copy of every parameter
            if getattr(w, "low_precision_dtype", None) == torch.float16:
                raise NotImplementedError(FP16_STAGE0_MESSAGE)
            for lps, fps in zip(w.fp16_groups, w.fp32_groups):
                for lp, fp in zip(lps, fps):
                    if lp in self.names:
                        self.names[fp] = self.names[lp]
            return "replicated", {}
        if hasattr(w, "fp32_partitioned_groups_flat") and hasattr(w, "grad_position"):
            flats = w.fp32_partitioned_groups_flat
            kind = "zero3"
        elif hasattr(w, "single_partition_of_fp32_groups") and hasattr(w, "bit16_groups"):
            flats = w.single_partition_of_fp32_groups
            kind = "zero12"
        elif hasattr(w, "fp32_groups_flat_partition") and hasattr(w, "bf16_groups"):
            flats = w.fp32_groups_flat_partition
            kind = "bf16"
        else:
            raise NotImplementedError(
                f"ds_muon: DeepSpeed wrapped the optimizer in {type(w).__name__}, which ds_muon cannot describe "
                "(supported: no wrapper (stage 0, fp32), DeepSpeedZeroOptimizer (ZeRO-1/2), BF16_Optimizer, "
                "DeepSpeedZeroOptimizer_Stage3). With fp16/bf16 at stage 0, use ZeRO stage 1 or 2 instead"
            )
        self.offload = bool(getattr(w, "cpu_offload", False) or getattr(w, "offload_optimizer", False))
        if self.offload:
            device = _offload_device(self.engine)
            if device != "cpu" or getattr(w, "swap_optimizer", False):
                raise NotImplementedError(OFFLOAD_MESSAGE.format(device=device))
            ratio = getattr(w, "partial_offload", 1.0)
            if ratio != 1.0:
                raise NotImplementedError(PARTIAL_OFFLOAD_MESSAGE.format(ratio=ratio))
        return kind, {id(t): i for i, t in enumerate(flats)}

    def _name(self, p: torch.Tensor, fallback: str) -> str:
        return self.names.get(p, fallback)

    def flat_partitions(self) -> List[torch.Tensor]:
        """The flat fp32 partitions DeepSpeed steps (none when it steps the parameters themselves)."""
        w = self.wrapper
        if self.kind == "zero3":
            return list(w.fp32_partitioned_groups_flat)
        if self.kind == "zero12":
            return list(w.single_partition_of_fp32_groups)
        if self.kind == "bf16":
            return list(w.fp32_groups_flat_partition)
        return []

    # -- the adapter ----------------------------------------------------------
    def grad_final_at_hook(self, param: torch.Tensor, context: BindContext) -> bool:
        """Never: DeepSpeed reduces gradients in its own hooks and steps on its partitions."""
        return False

    def bind(self, param: torch.Tensor, name: str, context: BindContext) -> ParamBinding:
        if self.kind == "replicated":
            if param.ndim < 2:
                raise RuntimeError(f"ds_muon: {name} (shape {tuple(param.shape)}) reached a Muon group flattened by "
                                   f"{type(self.wrapper).__name__}; ds_muon cannot describe that wrapper's layout")
            return bind_replicated(param, self._name(param, name), _dp_group(self.engine))
        i = self.flats.get(id(param))
        if i is None:
            raise RuntimeError(
                f"ds_muon: {name} (shape {tuple(param.shape)}) is not one of the flat fp32 partitions DeepSpeed's "
                f"{type(self.wrapper).__name__} built; the engine was rebuilt or the optimizer re-used. "
                f"Bind the optimizer to the engine that steps it: {HOW_TO_BIND}")
        if self.kind == "zero3":
            return self._bind_zero3(param, i)
        return self._bind_zero12(param, i)

    def _bind_zero12(self, flat: torch.Tensor, i: int) -> ParamBinding:
        w = self.wrapper
        lps = w.bit16_groups[i] if self.kind == "zero12" else w.bf16_groups[i]
        slots: List[MatrixSlot] = []
        for j, lp in enumerate(lps):
            key = self._name(lp, f"group{i}.param{j}")
            if lp.numel() == 0:
                continue
            m = getattr(lp, "_hp_mapping", None)
            if m is None:
                slots.extend(block_slots(lp, key, 0, 0) if is_tagged(lp)
                             else [MatrixSlot(key, tuple(lp.shape), None, 0, transposed=is_transposed(lp))])
                continue
            lp_addr, hp_addr = m.lp_fragment_address, m.hp_fragment_address
            if lp_addr.numel != hp_addr.numel:
                raise RuntimeError(f"ds_muon: DeepSpeed's fragment of {key} has {lp_addr.numel} elements in the "
                                   f"parameter and {hp_addr.numel} in the partition")
            if is_tagged(lp):  # split rows / experts: blocks clipped to the fragment
                _no_tp(lp, key)
                lo = int(lp_addr.start)
                slots.extend(block_slots(lp, key, lo, lo + int(lp_addr.numel), int(hp_addr.start)))
                continue
            slots.append(MatrixSlot(key, tuple(lp.shape), Piece(int(lp_addr.start), int(lp_addr.numel)),
                                    int(hp_addr.start), transposed=is_transposed(lp)))
        return ParamBinding(flat, _flat_view, slots, group=w.real_dp_process_group[i])

    def _bind_zero3(self, flat: torch.Tensor, i: int) -> ParamBinding:
        import torch.distributed as dist

        w = self.wrapper
        group = w.sub_group_process_groups[i] if hasattr(w, "sub_group_process_groups") else w.dp_process_group
        rank = dist.get_rank(group=group)
        slots: List[MatrixSlot] = []
        for j, lp in enumerate(w.fp16_groups[i]):
            key = self._name(lp, f"subgroup{i}.param{j}")
            shape = tuple(lp.ds_shape)
            sub, offset, part = w.grad_position[w.get_param_id(lp)]
            if sub != i:
                raise RuntimeError(f"ds_muon: DeepSpeed places {key} in sub-group {sub}, not {i}")
            per_rank = int(lp.ds_tensor.ds_numel)
            if per_rank != part:
                raise RuntimeError(f"ds_muon: {key}: ds_tensor holds {per_rank} elements, grad_position {part}")
            start = rank * per_rank
            length = min(per_rank, int(lp.ds_numel) - start)
            piece = Piece(start, length) if length > 0 else None
            if is_tagged(lp):  # split rows / experts: blocks clipped to this rank's partition
                _no_tp(lp, key)
                slots.extend(block_slots(lp, key, start, start + max(length, 0), int(offset), shape))
                continue
            slots.append(MatrixSlot(key, shape, piece, int(offset) if piece else 0, transposed=is_transposed(lp)))
        return ParamBinding(flat, _flat_view, slots, group=group)


def _offload_device(engine) -> str:
    config = engine.zero_offload_optimizer() if hasattr(engine, "zero_offload_optimizer") else None
    device = getattr(config, "device", "cpu")
    return str(getattr(device, "value", device))


def _no_tp(lp, key: str) -> None:
    if getattr(lp, TENSOR_PARALLEL, None) is not None:
        raise NotImplementedError(f"ds_muon: {key} is tagged tensor_parallel; with ZeRO partitions ds_muon supports "
                                  "split rows and expert stacks, not tensor-parallel shards (use ZeRO stage 0)")


def _dp_group(engine):
    for attr in ("seq_data_parallel_group", "data_parallel_group"):
        g = getattr(engine, attr, None)
        if g is not None:
            return g
    return None


def check_no_deepspeed_muon_tags(params, names: Optional[Dict] = None) -> None:
    """DeepSpeed's ZeRO-1/2 runs *its own* Muon inside the gradient reduction for any
    parameter tagged ``use_muon=True`` when the optimizer's class name contains "muon"
    (ours does).  That would orthogonalize twice: refuse, naming the parameter."""
    tagged = [p for p in params if getattr(p, "use_muon", False) is True]
    if tagged:
        name = (names or {}).get(tagged[0], f"a parameter of shape {tuple(tagged[0].shape)}")
        raise ValueError(
            f"ds_muon: {name} (and {len(tagged) - 1} more) carries DeepSpeed's own `use_muon=True` tensor "
            "attribute (set by a config with \"type\": \"muon\" or by hand). DeepSpeed's ZeRO-1/2 would then run "
            "its built-in Muon inside the gradient reduction on top of ds_muon. Use \"type\": \"DsMuon\" and "
            "remove the attribute (del p.use_muon) on every parameter")

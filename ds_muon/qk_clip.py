"""``ds_muon.QKClip``: QK-clip (MuonClip, Kimi K2, arXiv 2507.20534) applied where the rows live.

``Muon(..., qk_clip=QKClip(model, tau=100.0, alpha=0.5))``.  After each step, every attention head whose
largest pre-softmax logit since the step before, ``S_max^h``, exceeded ``tau`` has its query rows scaled by
``gamma_h ** alpha`` and its key rows by ``gamma_h ** (1 - alpha)``, ``gamma_h = min(1, tau / S_max^h)``
(the maths, and the grouped-query and MLA policies: :mod:`ds_muon.rules.qk_clip`).

* ``S_max`` is recorded per head by :class:`ds_muon.models.attention_logits.LogitRecorder` (a wrapper around
  the model's own attention function), over every forward since the last step (gradient accumulation
  included; the step that reads them starts the next window), and reduced over the ranks with one
  ``all_reduce(MAX)`` of every head's maximum, concatenated, per step, in the optimizer's process group.
* The rows are scaled on each rank's own pieces, as the optimizer's layout describes them (the
  :class:`~ds_muon.engine.exchange.layout.MatrixSlot` pieces of each binding): a DTensor's local shard (FSDP2), a
  flat parameter (FSDP1), DeepSpeed's fp32 partition (before DeepSpeed copies it into the model), a
  replica (DDP).  No weight is gathered; every rank multiplies the same elements by the same fp32 factors,
  so a sharded run stays bitwise equal to one process.
* DeepSpeed steps one partition per ``Muon.step`` call: the maxima are reduced once per training step (the
  first call after a forward) and each call scales the q/k matrices it holds.
* ``apply_in_forward=True`` (updates deferred to the next forward) is refused: the clip must follow the
  update.  A q/k projection's bias (Qwen2, GPT-2, ``attention_bias=True``) is scaled with its rows, where it
  lives (an AdamW tensor: the model's own, a DTensor's local rows, an FSDP1 flat slice, a ZeRO partition).

The q and k weights of each attention module are read from the module: separate ``q_proj``/``k_proj``
(Llama, Qwen, Mistral, …), the fused projections :mod:`ds_muon.models.fused` knows (Phi-3 ``qkv_proj``,
GPT-NeoX ``query_key_value`` interleaved per head, GPT-2 ``c_attn`` stored ``[in, out]``) and MLA
(``q_b_proj``/``q_proj`` with ``kv_b_proj``, DeepSeek-V3 style).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .engine.exchange.layout import global_shape, is_flat_shard, local_data
from .engine.exchange.slots import logical_blocks, strided_blocks
from .tensors.tag_keys import BLOCKS, is_tagged
from .models.attention_logits import LogitRecorder
from .models.fused import READERS
from .rules.qk_clip import clip_gammas, head_scales, mla_row_factors, piece_factors, row_factors

_WRAPPER_TOKENS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter or module name without the wrappers' own levels (FSDP1, activation checkpointing, compile)."""
    for t in _WRAPPER_TOKENS:
        name = name.replace(t, "")
    return name


@dataclass
class _Projection:
    """One weight that makes q and/or k of an attention module: which output features belong to which head."""

    name: str  # clean parameter name
    module: str  # the attention module's (recorder's) name
    kind: str  # "q", "k", "qkv" (fused), "mla_q", "mla_kv"
    out_features: int
    transposed: bool  # stored [in, out]
    heads: Dict[str, Tuple[int, int]]  # fused: label ("q3", "k1") -> (first output feature, count)
    bias: Optional[str] = None  # clean name of its bias (one element per output feature), if it has one


class QKClip:
    """QK-clip after every step of the :class:`~ds_muon.Muon` it is passed to (see the module docstring).

    ``tau``: the largest pre-softmax logit a head may keep (the paper's 100); ``alpha``: the share of the
    scale the query takes (0.5: both by ``sqrt(gamma)``).  ``recorder``: what records ``S_max`` (default
    ``ds_muon.models.attention_logits.LogitRecorder(model)``; anything with ``maxima()``, ``reset()`` and
    ``heads(name)``).  After a step, :attr:`last_s_max` holds each head's reduced maximum and
    :attr:`clipped_heads` how many heads were clipped (``Muon.summary()`` shows both)."""

    def __init__(self, model: nn.Module, tau: float = 100.0, alpha: float = 0.5, recorder=None):
        if not isinstance(model, nn.Module):
            raise ValueError(f"ds_muon: QKClip(model=...) needs the nn.Module whose attention it clips, got "
                             f"{type(model).__name__}")
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"ds_muon: QKClip tau={tau!r} must be a finite number > 0 (the paper uses 100)")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"ds_muon: QKClip alpha={alpha!r} must be a number in [0, 1] (0.5: q and k share the "
                             "scale equally)")
        self.model, self.tau, self.alpha = model, float(tau), float(alpha)
        if recorder is None:
            recorder = LogitRecorder(model)  # (a model's recorder is one: LogitRecorder(model) returns it again)
        self.recorder = recorder
        self.last_s_max: Dict[str, torch.Tensor] = {}
        self.clipped_heads = 0  # in the last step
        self.clipped_total = 0  # over all steps
        self.steps = 0
        self._projections: Optional[Dict[str, _Projection]] = None
        self._factors: Dict[str, torch.Tensor] = {}  # clean parameter name -> factor per output feature
        self._forwards = 0  # forwards since construction (the window of the maxima)
        self._reduced_at = -1  # self._forwards when the maxima were last reduced
        self._applied: set = set()  # matrix keys scaled with the current factors
        self._seen: set = set()  # clean names of q/k weights found in some binding
        self._seen_biases: set = set()  # clean names of q/k biases found among the optimizer's tensors
        self._bias_bindings: Dict[int, object] = {}  # DeepSpeed: a flat AdamW partition's binding, by id
        self._fsdp1 = None  # FSDP1: which module owns each flat parameter (integrations.fsdp1's index)
        self._slot_cache: Dict[tuple, object] = {}
        self._lookup_cache: Optional[tuple] = None  # (the optimizer's binding signature, its lookups)
        self._position_cache: Dict[tuple, torch.Tensor] = {}  # a piece's element positions (fixed per layout)
        # counts attention calls, so a step knows whether any forward ran since the last reduce (every rank
        # alike: all run their forwards), even when the model is called below its root
        self._hooks = [model.get_submodule(n).register_forward_pre_hook(self._on_forward) for n in recorder.maxima()]
        self.projections()  # an attention layout it cannot clip raises now, before any training

    # -- settings --------------------------------------------------------------------------------
    def settings(self) -> Tuple[float, float]:
        """What must be equal on every rank (compared by the step's agreement)."""
        return (self.tau, self.alpha)

    def __repr__(self) -> str:
        return f"QKClip(tau={self.tau}, alpha={self.alpha})"

    def remove(self) -> None:
        """Stop recording (removes the hooks; the optimizer then must not step with this clip)."""
        for h in self._hooks:
            h.remove()
        if hasattr(self.recorder, "remove"):
            self.recorder.remove()

    def _on_forward(self, module, args):
        self._forwards += 1

    # -- what the model's attention is made of ---------------------------------------------------------
    def projections(self) -> Dict[str, _Projection]:
        """Clean parameter name -> the q/k projection it is, for every attention module the recorder names."""
        if self._projections is None:
            out: Dict[str, _Projection] = {}
            for name in self.recorder.maxima():
                for proj in self._projections_of(name):
                    out[proj.name] = proj
            if not out:
                raise ValueError("ds_muon: QKClip found no attention module in the model (the recorder names none)")
            self._projections = out
        return self._projections

    def _projections_of(self, name: str) -> List[_Projection]:
        module = self.model.get_submodule(name)
        nq, nkv, hd = (int(x) for x in self.recorder.heads(name))
        clean = clean_name(name)
        prefix = clean + "." if clean else ""
        config = getattr(module, "config", None) or getattr(self.model, "config", None)
        what = type(module).__name__
        if hasattr(module, "kv_b_proj"):  # MLA
            q = "q_b_proj" if getattr(module, "q_b_proj", None) is not None else "q_proj"
            nope, rope = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
            v = int(config.v_head_dim)
            return [_Projection(prefix + f"{q}.weight", name, "mla_q", nq * (nope + rope), False, {},
                                _bias(module, q, prefix)),
                    _Projection(prefix + "kv_b_proj.weight", name, "mla_kv", nq * (nope + v), False, {},
                                _bias(module, "kv_b_proj", prefix))]
        if getattr(module, "q_proj", None) is not None and getattr(module, "k_proj", None) is not None:
            return [_Projection(prefix + f"{w}_proj.weight", name, w, n * hd, False, {},
                                _bias(module, f"{w}_proj", prefix)) for w, n in (("q", nq), ("k", nkv))]
        for path, reader in READERS.get(what, {}).items():
            child = path.rsplit(".", 1)[0] if "." in path else ""
            shape = _weight_shape(module, path)
            if shape is None:
                continue
            plan = reader(module, path, shape, config, per_head=True)
            if not plan.what.startswith("q|k|v"):
                continue
            heads = {}
            for label, (rows, cols) in plan.blocks.items():
                run = cols if plan.transposed else rows
                if run is None or len(run) != 2:
                    raise NotImplementedError(f"ds_muon: QKClip: {name} ({what}): the {label} block of {path} is not "
                                              "a run of output features; its layout is not supported")
                if label[0] in "qk":
                    heads[label] = (int(run[0]), int(run[1]))
            return [_Projection(prefix + path, name, "qkv", int(shape[1] if plan.transposed else shape[0]),
                                plan.transposed, heads, _bias(module, child, prefix))]
        raise NotImplementedError(f"ds_muon: QKClip: {name} ({what}) has neither q_proj/k_proj nor a fused q|k|v "
                                  "projection ds_muon.models.fused knows; its q and k rows cannot be found")

    # -- the step ----------------------------------------------------------------------------------
    def after_step(self, opt) -> None:
        """Called by ``Muon.step`` once the updates have landed: reduce the maxima (once per window), then
        scale this rank's pieces of the q/k matrices the optimizer holds in this call."""
        projections = self.projections()
        if self._reduced_at != self._forwards:
            self._reduce(opt, projections)
        self._scale(opt, projections)

    def _reduce(self, opt, projections) -> None:
        maxima = self.recorder.maxima()
        self.recorder.reset()  # the next window starts now (DeepSpeed's later calls of this step use the factors)
        names = sorted({p.module for p in projections.values()})
        local = [maxima[n].detach().to(torch.float32).reshape(-1) for n in names]
        flat = torch.cat(local) if local else torch.empty(0)
        group, world = opt.runtime.step_group()
        if world > 1:
            device = flat.device
            if dist.get_backend(group) == "nccl" and device.type != "cuda":
                flat = flat.to(torch.device("cuda", torch.cuda.current_device()))
            flat = flat.clone()
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
            flat = flat.to(device)
        self.last_s_max, gammas, at = {}, {}, 0
        for n, t in zip(names, local):
            s = flat[at:at + t.numel()].cpu()
            at += t.numel()
            self.last_s_max[n] = s
            gammas[n] = clip_gammas(s, self.tau)
        self.clipped_heads = int(sum(int((g < 1).sum()) for g in gammas.values()))
        self.clipped_total += self.clipped_heads
        self.steps += 1
        self._factors = {}
        for p in projections.values():
            g = gammas[p.module]
            if bool((g < 1).any()):
                self._factors[p.name] = self._out_factors(p, g)
                if p.bias is not None:  # q = W x + b: b scales with W's rows
                    self._factors[p.bias] = self._factors[p.name]
        self._applied = set()
        self._reduced_at = self._forwards

    def _out_factors(self, p: _Projection, gammas: torch.Tensor) -> torch.Tensor:
        nq, nkv, hd = (int(x) for x in self.recorder.heads(p.module))
        if p.kind in ("mla_q", "mla_kv"):
            config = getattr(self.model.get_submodule(p.module), "config", None) or self.model.config
            q, kv = mla_row_factors(gammas, self.alpha, int(config.qk_nope_head_dim), int(config.qk_rope_head_dim),
                                    int(config.v_head_dim))
            return q if p.kind == "mla_q" else kv
        q_scale, k_scale = head_scales(gammas, nkv, self.alpha)
        if p.kind == "q":
            return row_factors(q_scale, hd)
        if p.kind == "k":
            return row_factors(k_scale, hd)
        out = torch.ones(p.out_features, dtype=torch.float32)
        for label, (start, n) in p.heads.items():
            out[start:start + n] = (q_scale if label[0] == "q" else k_scale)[int(label[1:])]
        return out

    # -- rows where they live -----------------------------------------------------------------------
    def _lookups(self, opt):
        """(model tensor id -> clean name, clean name -> tensor, optimizer tensor id -> the name it binds under),
        made once per set of bound tensors (the optimizer's binding signature), not in every clipping step."""
        sig = (id(opt), opt.runtime.signature)
        if self._lookup_cache is not None and self._lookup_cache[0] == sig:
            return self._lookup_cache[1]
        self._lookup_cache = (sig, self._make_lookups(opt))
        return self._lookup_cache[1]

    def _make_lookups(self, opt):
        by_id = {id(p): clean_name(n) for n, p in self.model.named_parameters()}
        tensors = {clean_name(n): p for n, p in self.model.named_parameters()}
        names = {id(p): opt.runtime.name(gi, pi) for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])}
        return by_id, tensors, names

    def _q_k_slots(self, opt, projections):
        """``(binding, slot, (clean name, key base, block suffix))`` of every q/k matrix bound in this call."""
        by_id, tensors, names = self._lookups(opt)
        for b in opt.runtime.bindings.values():
            for slot in b.matrices:
                where = self._resolve(b, slot, by_id, names, projections)
                if where is not None:
                    yield b, slot, where, tensors

    def check(self, opt) -> None:
        """Before the step changes anything (``Muon.step`` calls it once the tensors are bound; a failure is
        raised on every rank by the step's agreement): the attention layouts are known, and every q/k weight
        is a Muon matrix.  DeepSpeed binds one partition per call, so there the second part is checked once a
        whole step has bound every partition (at the next step)."""
        projections = self.projections()
        biases = {p.bias for p in projections.values() if p.bias is not None}
        if len(self._seen) == len(projections) and self._seen_biases == biases:
            return  # every q/k weight and bias has been found (bindings do not drop tensors)
        for _, _, (pname, _, _), _ in self._q_k_slots(opt, projections):
            self._seen.add(pname)
        for name, _, _ in self._bias_sites(opt, biases):
            self._seen_biases.add(name)
        missing = sorted(set(projections) - self._seen) + sorted(biases - self._seen_biases)
        whole = not opt.adapter.applies_in_step or (self.steps >= 1 and self._reduced_at != self._forwards)
        if missing and whole:
            raise ValueError(f"ds_muon: QKClip: {missing[0]} (and {len(missing) - 1} more) is a q/k weight that no "
                             "Muon param group holds (or a q/k bias no param group holds); QK-clip scales the rows "
                             "of Muon matrices only. Put the q/k projections in a Muon group and their biases in "
                             "the optimizer (muon_param_groups does both)")

    def _scale(self, opt, projections) -> None:
        if not self._factors:
            return  # no head over tau: nothing to touch
        for b, slot, (pname, base, suffix), tensors in self._q_k_slots(opt, projections):
            factors = self._factors.get(pname)
            if factors is None or slot.key in self._applied or slot.piece is None or slot.piece.numel == 0:
                continue
            if b.copied:
                raise NotImplementedError(f"ds_muon: QKClip: {slot.key} has no flat view in the optimizer's "
                                          "binding; its rows cannot be scaled in place")
            cols, transposed = self._stored(b, slot, pname, tensors, projections[pname])
            if not suffix and not transposed and slot.piece.rows == 1 and slot.local_view is None:
                _multiply_rows(b, slot, factors, cols)  # a run of whole and partial rows: no index tensors
            else:
                key = (id(b), slot.key, slot.piece)
                positions = self._position_cache.get(key)
                if positions is None:
                    positions = self._positions(b, slot, pname, base, suffix, tensors, projections[pname])
                    self._position_cache[key] = positions
                _multiply(b, slot, piece_factors(factors, positions, cols, transposed))
            self._applied.add(slot.key)
        biases = {p.bias for p in projections.values() if p.bias is not None and p.bias in self._factors}
        for name, view, start in self._bias_sites(opt, biases):
            if view is None or view.numel() == 0 or ("bias", name) in self._applied:
                continue
            f = self._factors[name][start:start + view.numel()].to(view.device)
            with torch.no_grad():
                view.copy_((view.to(torch.float32) * f).to(view.dtype))
            self._applied.add(("bias", name))

    def _bias_sites(self, opt, biases):
        """``(clean bias name, the 1-D local data this rank holds of it or None, its first element's index)`` for
        each of ``biases`` among the tensors this call steps: the model's own tensor (local, DDP; FSDP2: the
        DTensor's local rows), an FSDP1 flat parameter's slice, a DeepSpeed fp32 partition's fragment."""
        if not biases:
            return
        by_id = {id(p): clean_name(n) for n, p in self.model.named_parameters()}
        names = getattr(opt.adapter, "names", {}) or {}
        flats = getattr(opt.adapter, "flats", None) or {}
        for g in opt.param_groups:
            for p in g["params"]:
                name = by_id.get(id(p))
                if name is None and not hasattr(p, "_fqns") and id(p) not in flats:
                    name = clean_name(names.get(p, "")) or None  # DeepSpeed stage 0 bf16: an fp32 copy
                if name in biases:
                    if getattr(p, "_fsdp_flattened", False):
                        raise NotImplementedError(f"ds_muon: QKClip: {name} is an FSDP1 use_orig_params=True view; "
                                                  "scaling its bias is not supported there (use_orig_params=False "
                                                  "or FSDP2)")
                    yield name, local_data(p).view(-1), _global_offset(p)
                elif hasattr(p, "_fqns"):  # an FSDP1 flat parameter: its originals' slices of this shard
                    from .integrations.fsdp1 import _shard_piece

                    prefix = self._fsdp1_prefix(p)
                    for i, fqn in enumerate(p._fqns):
                        full = clean_name(prefix + fqn)
                        if full in biases:
                            piece, off = _shard_piece(p, i, full)
                            yield full, None if piece is None else p.detach().view(-1)[off:off + piece.numel], \
                                0 if piece is None else piece.offset
                elif id(p) in flats:  # a DeepSpeed fp32 partition: its fragments, as the adapter binds them
                    b = self._bias_bindings.get(id(p))
                    if b is None:
                        from .integrations.base import BindContext

                        b = self._bias_bindings[id(p)] = opt.adapter.bind(p, "flat", BindContext(
                            opt.process_group, opt.model, g))
                    for slot in b.matrices:
                        key = clean_name(slot.key)
                        if key in biases:
                            piece = slot.piece
                            view = None if piece is None else b.flat(p)[slot.local_offset:slot.local_offset +
                                                                         piece.numel]
                            yield key, view, 0 if piece is None else piece.offset

    def _resolve(self, b, slot, by_id, names, projections):
        """(clean parameter name, slot key base, block suffix) of a slot that is a q/k projection, else None."""
        key = (id(b), slot.key)  # (bindings live as long as the optimizer's layouts)
        if key in self._slot_cache:
            return self._slot_cache[key]
        out = None
        pname = by_id.get(id(b.param))
        base = names.get(id(b.param), slot.key)
        if pname in projections and slot.key.startswith(base):  # the model's own tensor (local, DDP, FSDP2)
            out = (pname, base, slot.key[len(base):])
        else:  # a flat tensor (FSDP1 flat parameters, DeepSpeed partitions): slots are keyed by the model's names
            k = clean_name(slot.key)
            base = k.split("[", 1)[0]
            if base in projections:
                raw = slot.key.split("[", 1)[0]
                out = (base, raw, slot.key[len(raw):])
        self._slot_cache[key] = out
        return out

    def _tagged(self, b, pname, tensors):
        """The tensor that carries ``pname``'s shape and tags: the binding's own (local, DDP, FSDP2), the model's
        parameter of that name (DeepSpeed keeps the model's tensors), or the tagged stand-in the FSDP1 adapter
        binds a flat parameter's original by (FSDP1 hides the tensor itself); None when there is none."""
        t = tensors.get(pname)
        if t is not None and not is_flat_shard(t) and len(global_shape(t)) >= 2:
            return t
        fqns = getattr(b.param, "_fqns", None)
        if fqns is not None:
            from .integrations.fsdp1 import _tag_carrier

            prefix = self._fsdp1_prefix(b.param)
            for i, fqn in enumerate(fqns):
                if clean_name(prefix + fqn) == pname:
                    return _tag_carrier(b.param, i, pname)
        return None

    def _fsdp1_prefix(self, flat) -> str:
        """The name of the FSDP1 module that owns ``flat`` (as the FSDP1 adapter keys its originals)."""
        from .integrations.fsdp1 import _Fsdp1Index

        if self._fsdp1 is None or id(flat) not in self._fsdp1.flat:
            self._fsdp1 = _Fsdp1Index(self.model)
        entry = self._fsdp1.flat.get(id(flat))
        return entry[1] if entry is not None else ""

    def _stored(self, b, slot, pname, tensors, proj) -> Tuple[int, bool]:
        """(columns of the stored tensor, stored [in, out])."""
        t = self._tagged(b, pname, tensors)
        shape = tuple(global_shape(t)) if t is not None else tuple(slot.shape)
        cols = int(math.prod(shape[1:]))
        transposed = proj.transposed
        want = shape[1] if transposed else shape[0]
        if int(want) != proj.out_features:
            raise ValueError(f"ds_muon: QKClip: {pname} has {want} output features; the head layout of "
                             f"{proj.module} says {proj.out_features}")
        return cols, transposed

    def _positions(self, b, slot, pname, base, suffix, tensors, proj) -> torch.Tensor:
        """Where each element of this rank's piece sits in the stored tensor's row-major flattening."""
        piece = slot.piece
        e = torch.arange(piece.numel, dtype=torch.int64)
        m = piece.offset + (e // piece.length) * piece.stride + e % piece.length if piece.rows > 1 else piece.offset + e
        if not suffix:
            return m
        t = self._tagged(b, pname, tensors)
        if t is None or not is_tagged(t):
            raise NotImplementedError(f"ds_muon: QKClip: {slot.key} is a block of {pname}, whose tags this process "
                                      "cannot read; use separate q/k projections or another stack")
        if getattr(t, BLOCKS, None) is not None:
            for key, _, off, sizes, strides in strided_blocks(t, base):
                if key == slot.key:
                    pos = torch.zeros_like(m)
                    rest = m
                    for n, st in zip(reversed(sizes), reversed(strides)):
                        rest, r = torch.div(rest, n, rounding_mode="floor"), rest % n
                        pos += r * st
                    return off + pos
        else:
            for key, _, start in logical_blocks(t, base):
                if key == slot.key:
                    return start + m
        raise RuntimeError(f"ds_muon: QKClip: no block {slot.key} in the tags of {pname}")

    # -- reporting -----------------------------------------------------------------------------------
    def report(self) -> dict:
        """What ``Muon.summary()`` shows: settings, the last step's S_max per head and the clipped counts."""
        return {"tau": self.tau, "alpha": self.alpha, "steps": self.steps, "clipped_heads": self.clipped_heads,
                "clipped_total": self.clipped_total,
                "s_max": {n: [float(x) for x in s] for n, s in self.last_s_max.items()}}


def clip_from_settings(model: nn.Module, spec, where: str = "qk_clip") -> QKClip:
    """A :class:`QKClip` on ``model`` from the front doors' ``{"tau": 100.0, "alpha": 0.5}`` (the DsMuon JSON,
    ``ds_muon.accelerate.prepare(qk_clip=...)``, ``MuonTrainer`` settings); a QKClip passes through."""
    if isinstance(spec, QKClip):
        return spec
    if not isinstance(spec, dict):
        raise ValueError(f'ds_muon: {where} must be an object like {{"tau": 100.0, "alpha": 0.5}}, got {spec!r}')
    unknown = sorted(set(spec) - {"tau", "alpha"})
    if unknown:
        raise ValueError(f'ds_muon: unknown key(s) {unknown} in {where}; it takes "tau" and "alpha"')
    return QKClip(model, **spec)


def _bias(module: nn.Module, child: str, prefix: str) -> Optional[str]:
    """The clean name of ``module.<child>``'s bias, None when it has none."""
    m = module.get_submodule(child) if child else module
    if getattr(m, "bias", None) is None:
        return None
    return prefix + (child + "." if child else "") + "bias"


def _global_offset(p: torch.Tensor) -> int:
    """Where a 1-D tensor's local data starts in the whole tensor: 0, or a DTensor shard's global offset."""
    if not (hasattr(p, "placements") and hasattr(p, "device_mesh")):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return int(compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1][0])


def _weight_shape(module: nn.Module, path: str) -> Optional[Tuple[int, ...]]:
    """The global shape of ``module``'s weight at ``path``: the parameter's, or, where a stack hides it (FSDP1
    flattens it away), the Linear's ``[out_features, in_features]`` or the Conv1D's ``[nx, nf]``; None when the
    module has no such weight."""
    try:
        return tuple(global_shape(module.get_parameter(path)))
    except AttributeError:
        pass
    child_path, _, leaf = path.rpartition(".")
    try:
        child = module.get_submodule(child_path) if child_path else module
    except AttributeError:
        return None
    if leaf == "weight" and isinstance(getattr(child, "out_features", None), int):
        return (int(child.out_features), int(child.in_features))
    if leaf == "weight" and isinstance(getattr(child, "nf", None), int) and isinstance(getattr(child, "nx", None), int):
        return (int(child.nx), int(child.nf))  # transformers' Conv1D: stored [in, out]
    return None


@torch.no_grad()
def _multiply_rows(b, slot, factors: torch.Tensor, cols: int) -> None:
    """A contiguous piece ``[offset, offset + length)`` of an ``[out, in]`` matrix (``cols`` columns), multiplied
    in place row by row: a partial first row, whole rows as one ``[rows, cols]`` view, a partial last row."""
    flat = b.flat(b.param)
    v = flat[slot.local_offset:slot.local_offset + slot.piece.numel]
    f = factors.to(v.device)
    pos, end, at = slot.piece.offset, slot.piece.offset + slot.piece.length, 0
    while pos < end:
        row, col = divmod(pos, cols)
        if col == 0 and end - pos >= cols:
            n = (end - pos) // cols
            block = v[at:at + n * cols].view(n, cols)
            block.copy_((block.to(torch.float32) * f[row:row + n, None]).to(v.dtype))
            pos, at = pos + n * cols, at + n * cols
            continue
        n = min(cols - col, end - pos)
        part = v[at:at + n]
        part.copy_((part.to(torch.float32) * f[row]).to(v.dtype))
        pos, at = pos + n, at + n


@torch.no_grad()
def _multiply(b, slot, f: torch.Tensor) -> None:
    """This rank's piece of one matrix, multiplied in place by ``f`` (its elements' factors, in piece order)."""
    flat = b.flat(b.param)
    if slot.local_view is None:
        views = [(flat[slot.local_offset:slot.local_offset + slot.piece.numel], 0)]
    else:
        views, start = [], 0
        for rel, sizes, strides in slot.local_view:
            v = flat.as_strided(sizes, strides, flat.storage_offset() + slot.local_offset + rel)
            views.append((v, start))
            start += v.numel()
    for v, start in views:
        part = f[start:start + v.numel()].to(v.device).view(v.shape)
        v.copy_((v.to(torch.float32) * part).to(v.dtype))

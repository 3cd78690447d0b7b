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

This face reads the model and runs the step; the rest lives below it: the maths and the head layouts
(:mod:`ds_muon.rules.qk_clip`), multiplying a rank's piece in place (:mod:`ds_muon.engine.exchange.row_scale`),
finding the q/k pieces among each stack's tensors (:mod:`ds_muon.integrations.named_pieces`).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .engine.exchange.row_scale import block_positions, multiply_piece, multiply_rows, piece_positions
from .integrations.named_pieces import NamedPieces, clean_name, weight_shape
from .tensors.shape import global_shape
from .tensors.tag_keys import is_tagged
from .models.attention_logits import LogitRecorder
from .models.fused import READERS
from .rules.qk_clip import Projection, clip_gammas, fused_heads, out_factors, piece_factors, stored_columns


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
        self._projections: Optional[Dict[str, Projection]] = None
        self._factors: Dict[str, torch.Tensor] = {}  # clean parameter name -> factor per output feature
        self._forwards = 0  # forwards since construction (the window of the maxima)
        self._reduced_at = -1  # self._forwards when the maxima were last reduced
        self._applied: set = set()  # matrix keys scaled with the current factors
        self._seen: set = set()  # clean names of q/k weights found in some binding
        self._seen_biases: set = set()  # clean names of q/k biases found among the optimizer's tensors
        self._pieces = NamedPieces(model)  # this rank's pieces of the q/k weights and biases, on every stack
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
    def projections(self) -> Dict[str, Projection]:
        """Clean parameter name -> the q/k projection it is, for every attention module the recorder names."""
        if self._projections is None:
            out: Dict[str, Projection] = {}
            for name in self.recorder.maxima():
                for proj in self._projections_of(name):
                    out[proj.name] = proj
            if not out:
                raise ValueError("ds_muon: QKClip found no attention module in the model (the recorder names none)")
            self._projections = out
        return self._projections

    def _projections_of(self, name: str) -> List[Projection]:
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
            return [Projection(prefix + f"{q}.weight", name, "mla_q", nq * (nope + rope), False, {},
                               _bias(module, q, prefix)),
                    Projection(prefix + "kv_b_proj.weight", name, "mla_kv", nq * (nope + v), False, {},
                               _bias(module, "kv_b_proj", prefix))]
        if getattr(module, "q_proj", None) is not None and getattr(module, "k_proj", None) is not None:
            return [Projection(prefix + f"{w}_proj.weight", name, w, n * hd, False, {},
                               _bias(module, f"{w}_proj", prefix)) for w, n in (("q", nq), ("k", nkv))]
        for path, reader in READERS.get(what, {}).items():
            child = path.rsplit(".", 1)[0] if "." in path else ""
            shape = weight_shape(module, path)
            if shape is None:
                continue
            plan = reader(module, path, shape, config, per_head=True)
            if not plan.what.startswith("q|k|v"):
                continue
            heads = fused_heads(plan.blocks, plan.transposed, f"{name} ({what})", path)
            return [Projection(prefix + path, name, "qkv", int(shape[1] if plan.transposed else shape[0]),
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

    def _out_factors(self, p: Projection, gammas: torch.Tensor) -> torch.Tensor:
        _, nkv, hd = (int(x) for x in self.recorder.heads(p.module))
        mla = None
        if p.kind in ("mla_q", "mla_kv"):
            config = getattr(self.model.get_submodule(p.module), "config", None) or self.model.config
            mla = (int(config.qk_nope_head_dim), int(config.qk_rope_head_dim), int(config.v_head_dim))
        return out_factors(p, gammas, self.alpha, nkv, hd, mla)

    # -- rows where they live -----------------------------------------------------------------------
    def check(self, opt) -> None:
        """Before the step changes anything (``Muon.step`` calls it once the tensors are bound; a failure is
        raised on every rank by the step's agreement): the attention layouts are known, and every q/k weight
        is a Muon matrix.  DeepSpeed binds one partition per call, so there the second part is checked once a
        whole step has bound every partition (at the next step)."""
        projections = self.projections()
        biases = {p.bias for p in projections.values() if p.bias is not None}
        if len(self._seen) == len(projections) and self._seen_biases == biases:
            return  # every q/k weight and bias has been found (bindings do not drop tensors)
        for _, _, (pname, _, _), _ in self._pieces.matrix_slots(opt, projections):
            self._seen.add(pname)
        for name, _, _ in self._pieces.vector_pieces(opt, biases):
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
        for b, slot, (pname, base, suffix), tensors in self._pieces.matrix_slots(opt, projections):
            factors = self._factors.get(pname)
            if factors is None or slot.key in self._applied or slot.piece is None or slot.piece.numel == 0:
                continue
            if b.copied:
                raise NotImplementedError(f"ds_muon: QKClip: {slot.key} has no flat view in the optimizer's "
                                          "binding; its rows cannot be scaled in place")
            t = self._pieces.tagged(b, pname, tensors)  # (columns of the stored tensor: its shape, else the slot's)
            cols = stored_columns(tuple(global_shape(t)) if t is not None else tuple(slot.shape), projections[pname],
                                  pname)
            transposed = projections[pname].transposed
            if not suffix and not transposed and slot.piece.rows == 1 and slot.local_view is None:
                multiply_rows(b, slot, factors, cols)  # a run of whole and partial rows: no index tensors
            else:
                key = (id(b), slot.key, slot.piece)
                positions = self._position_cache.get(key)
                if positions is None:
                    positions = self._positions(b, slot, pname, base, suffix, tensors)
                    self._position_cache[key] = positions
                multiply_piece(b, slot, piece_factors(factors, positions, cols, transposed))
            self._applied.add(slot.key)
        biases = {p.bias for p in projections.values() if p.bias is not None and p.bias in self._factors}
        for name, view, start in self._pieces.vector_pieces(opt, biases):
            if view is None or view.numel() == 0 or ("bias", name) in self._applied:
                continue
            f = self._factors[name][start:start + view.numel()].to(view.device)
            with torch.no_grad():
                view.copy_((view.to(torch.float32) * f).to(view.dtype))
            self._applied.add(("bias", name))

    def _positions(self, b, slot, pname, base, suffix, tensors) -> torch.Tensor:
        """Where each element of this rank's piece sits in the stored tensor's row-major flattening."""
        m = piece_positions(slot.piece)
        if not suffix:
            return m
        t = self._pieces.tagged(b, pname, tensors)
        if t is None or not is_tagged(t):
            raise NotImplementedError(f"ds_muon: QKClip: {slot.key} is a block of {pname}, whose tags this process "
                                      "cannot read; use separate q/k projections or another stack")
        return block_positions(t, base, slot.key, m, pname)

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


_multiply_rows, _multiply = multiply_rows, multiply_piece  # their old names here (now engine.exchange.row_scale)
_Projection = Projection  # (now ds_muon.rules.qk_clip.Projection)

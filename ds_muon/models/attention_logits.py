"""S_max per query head on transformers models, recorded through transformers' attention-function registry.

QK-clip (MuonClip, Kimi K2, arXiv 2507.20534 §2.1) scales a head's query and key weights after the step by how
far its largest pre-softmax logit over the step's batches, ``S_max^h = max_{batch, i, j allowed} q_i·k_jᵀ·scaling``,
went past τ. The logits exist only inside the attention kernel (SDPA never forms them), so
:class:`LogitRecorder` registers, in ``transformers.AttentionInterface`` and ``AttentionMaskInterface``, one
wrapper per implementation (``ds_muon_logits_eager``, ``ds_muon_logits_sdpa``) and switches the attention
modules' configs to it. The wrapper computes the logits once more, in fp32 under ``torch.no_grad`` (autocast
off), takes their max per query head into a per-module buffer, and then calls the module's *own*
implementation with the same arguments, so the model's outputs and gradients do not change (bit for bit:
the mask function registered for the new name is the wrapped one's, so the model builds the same masks).

What the wrapper reads, and why:

* **which modules, which implementation**: a module is an attention module when its class's ``forward``
  dispatches through ``ALL_ATTENTION_FUNCTIONS`` (its code names it); the eager implementation wrapped is the
  ``*eager_attention_forward`` that forward names as its default, SDPA the one in the registry that forward
  uses (a model's local override included).
* **allowed positions**: from the ``attention_mask`` the implementation receives (a bool mask: True allows; an
  additive float mask: allowed where above half the dtype's minimum), sliced to the key length as eager does.
  Causal, padding, packed-sequence and sliding-window masks all arrive that way. With no mask, eager attends
  everywhere and SDPA is causal (top-left) when ``is_causal`` (the kwarg, else ``module.is_causal``, else True)
  and more than one query — the rule ``sdpa_attention_forward`` applies. Rows with no allowed key add nothing.
* **GQA**: query head ``h`` scores against key head ``h // (Hq / Hkv)``, the head ``repeat_kv`` gives it.
* **soft-capping** (Gemma 2 ``softcap``): S_max is the logit *before* the cap, the q·kᵀ·scaling the clip's
  weights control (the capped one is below the cap by construction). Additive position biases
  (``position_bias``) and attention sinks are not q·k and are left out.
* **MLA** (DeepSeek-V3): the query and key the implementation gets are ``[q_nope | q_rope]`` and
  ``[k_nope | k_rope]`` with the one rotary key shared by every head broadcast to all of them, so S_max per head
  is the same max of the full dot product. The clip then (Kimi K2, §2.1, "for MLA"): scales the head-specific
  non-rotary parts ``q^C`` (q_nope rows of ``q_proj``/``q_b_proj``) and ``k^C`` (k_nope rows of ``kv_b_proj``)
  by ``√γ_h`` each and the head-specific rotary query ``q^R`` (q_rope rows) by ``γ_h``, and leaves the shared
  rotary key ``k^R`` (``kv_a_proj_with_mqa``'s rope rows) untouched, since scaling it would touch every head.
  The qkclip rule applies that; this module only records.

Refused, with a clear error at install: flash-attention (its kernels take padding as varlen lengths
(``cu_seqlens``) and the window as a kwarg, a second mask language to re-derive) and flex attention (a
``BlockMask``), paged attention, and a config with no implementation set; load or switch the model to
``"sdpa"`` or ``"eager"`` first (``model.set_attn_implementation("sdpa")``). Models whose code branches on
the implementation's *name* (``== "eager"``: GPT-2 with ``reorder_and_upcast_attn``, Falcon, Gemma 4) take
their non-eager / non-SDPA branch under the new name; the tested families (Llama, Qwen2, Mistral, Gemma 2,
DeepSeek-V3) do not.

A module whose config names the wrapper but that no recorder routes (a ``copy.deepcopy`` of a recorded model:
a reference or EMA copy) runs its own implementation and records nothing. Buffers made while the model is on
the meta device are replaced on the first recorded call's device.

The maxima are a max, so a forward that runs twice (gradient checkpointing's recompute) records the same
values; eval forwards between steps are recorded too (call :meth:`LogitRecorder.reset` after them). The cost
is one more fp32 ``q·kᵀ`` per attention call, in query-row chunks of at most ``chunk_elements`` logits
(``benchmarks/qk_logits.py``, docs/PERFORMANCE.md).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

PREFIX = "ds_muon_logits_"
WRAPPED = ("eager", "sdpa")
CHUNK_ELEMENTS = 1 << 24  # 64 MiB of fp32 logits per chunk
# causal without a mask (SDPA's is_causal): rows in about this many blocks (of at least CAUSAL_BLOCK_ROWS), each
# scored against the keys up to its last row only, so about (n+1)/2n of the square is formed instead of all of it
CAUSAL_BLOCKS, CAUSAL_BLOCK_ROWS = 8, 64


@dataclass
class _Route:
    """Where one attention module's calls go: its recorder, its name there, the implementation it wraps."""

    recorder: "weakref.ref[LogitRecorder]"
    name: str
    base: Callable
    impl: str  # "eager" or "sdpa": what the wrapper stands for (SDPA's rule without a mask differs)


# module → route; one table for every recorder, so one registered wrapper serves them all
_ROUTES: "weakref.WeakKeyDictionary[nn.Module, _Route]" = weakref.WeakKeyDictionary()
_UNROUTED: "weakref.WeakKeyDictionary[nn.Module, _Route]" = weakref.WeakKeyDictionary()


def _recording_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """The registered implementation: record the module's logits, then run the implementation it wraps."""
    route = _ROUTES.get(module) or _unrouted(module)
    recorder = route.recorder()
    if recorder is not None:
        recorder._record(route.name, route.impl, module, query, key, attention_mask, args, kwargs)
    return route.base(module, query, key, value, attention_mask, *args, **kwargs)


def _no_recorder():
    return None


def _unrouted(module: nn.Module) -> _Route:
    """A module whose config names the wrapper but that no recorder routes (a deepcopy of a recorded model, a
    model built from a recorded one's config): it runs the implementation the name wraps and records nothing."""
    route = _UNROUTED.get(module)
    if route is None:
        impl = module.config._attn_implementation[len(PREFIX):]
        forward = _dispatching_forward(module)
        base = None
        if forward is not None:
            base = _eager_default(forward) if impl == "eager" else forward.__globals__["ALL_ATTENTION_FUNCTIONS"][impl]
        if base is None:
            raise RuntimeError(f"{type(module).__name__}: its config names the ds_muon logit-recording attention "
                               f"({module.config._attn_implementation!r}) but its own {impl!r} attention cannot be "
                               "found; set it back with model.set_attn_implementation('sdpa')")
        route = _UNROUTED[module] = _Route(_no_recorder, "", base, impl)
    return route


def _dispatching_forward(module: nn.Module):
    """The class's forward when it dispatches through transformers' attention registry, else None."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    if code is None or "ALL_ATTENTION_FUNCTIONS" not in code.co_names:
        return None
    return forward


def _eager_default(forward) -> Optional[Callable]:
    """The ``*eager_attention_forward`` the forward passes to ``get_interface`` as its default."""
    found = [forward.__globals__[n] for n in forward.__code__.co_names
             if n.endswith("eager_attention_forward") and callable(forward.__globals__.get(n))]
    return found[0] if len(found) == 1 else None


def heads_of(module: nn.Module) -> Tuple[int, int, int]:
    """``(num_query_heads, num_kv_heads, head_dim)`` of an attention module, from its config and attributes.

    ``head_dim`` is the q·k dimension (MLA: ``qk_nope_head_dim + qk_rope_head_dim``)."""
    config = getattr(module, "config", None)
    q_heads = getattr(config, "num_attention_heads", None) or getattr(module, "num_heads", None)
    if not q_heads:
        raise ValueError(f"{type(module).__name__}: no num_attention_heads in its config nor num_heads on it")
    kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
    head_dim = (getattr(module, "qk_head_dim", None) or getattr(module, "head_dim", None)
                or getattr(config, "head_dim", None) or config.hidden_size // q_heads)
    return int(q_heads), int(kv_heads), int(head_dim)


def _additive(mask: Optional[torch.Tensor], key_length: int) -> Optional[torch.Tensor]:
    """The mask the implementation got as a bias, 0 where it may attend and -inf where not, sliced to the
    keys; None = no mask. (Adding it is an order of magnitude faster on CPU than a broadcast masked_fill.)"""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(f"LogitRecorder reads 4-D tensor attention masks; got {type(mask).__name__} "
                         f"{getattr(mask, 'shape', '')}")
    mask = mask[..., :key_length]
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    # bf16 holds 0 and -inf exactly, at half the bytes of fp32; adding it to the fp32 logits is exact
    return torch.where(allowed, 0.0, float("-inf")).to(torch.bfloat16)


def _version(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # inference tensors keep no version counter
        return -1


class LogitRecorder:
    """Record, per attention module, the largest pre-softmax logit of each query head (``S_max``).

    ``LogitRecorder(model)`` installs it (a second call on the same model returns the same recorder);
    :meth:`maxima` reads this rank's maxima since the last :meth:`reset`; :meth:`remove` restores the model's
    attention implementation (switching it with ``model.set_attn_implementation`` meanwhile ends the recording
    too). Names are the modules' qualified names in ``model`` as given (install before
    wrapping it in a stack whose wrappers rename modules, e.g. FSDP1). ``chunk_elements`` bounds the fp32
    logits formed at once.
    """

    _live: "weakref.WeakKeyDictionary[nn.Module, LogitRecorder]" = weakref.WeakKeyDictionary()

    def __new__(cls, model: nn.Module, chunk_elements: int = CHUNK_ELEMENTS):
        existing = cls._live.get(model)
        if existing is not None:
            return existing
        return super().__new__(cls)

    def __init__(self, model: nn.Module, chunk_elements: int = CHUNK_ELEMENTS):
        if getattr(self, "_model", None) is not None:
            return  # the model's live recorder, returned by __new__
        if not isinstance(chunk_elements, int) or chunk_elements < 1:
            raise ValueError(f"LogitRecorder: chunk_elements must be a positive int, got {chunk_elements!r}")
        self._chunk = chunk_elements
        self._bias_cache = None
        modules, routes, configs = self._plan(model)
        self._modules: Dict[str, nn.Module] = modules
        self._heads = {name: heads_of(m) for name, m in modules.items()}
        self._maxima: Dict[str, torch.Tensor] = {}
        for name, module in modules.items():
            param = next(module.parameters(), None)
            device = param.device if param is not None else torch.device("cpu")
            self._maxima[name] = torch.full((self._heads[name][0],), float("-inf"), dtype=torch.float32,
                                            device=device)
        self._restore: List[Tuple[object, str]] = []
        self._install(routes, configs)
        self._model = weakref.ref(model)
        LogitRecorder._live[model] = self

    # -- install / remove ---------------------------------------------------------------------------------
    def _plan(self, model):
        """Every attention module, the implementation it wraps and its config's new name; raises, changes nothing."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"LogitRecorder(model): model must be a torch.nn.Module, got {type(model).__name__}")
        modules, routes, configs = {}, {}, {}
        for name, module in model.named_modules():
            forward = _dispatching_forward(module)
            if forward is None:
                continue
            config = getattr(module, "config", None)
            if config is None or not hasattr(config, "_attn_implementation"):
                raise ValueError(f"LogitRecorder: attention module {name!r} ({type(module).__name__}) has no "
                                 "transformers config to switch")
            impl = config._attn_implementation
            if isinstance(impl, str) and impl.startswith(PREFIX):
                owner = _ROUTES.get(module)
                if owner is not None and owner.recorder() is not None:
                    raise ValueError(f"LogitRecorder: attention module {name!r} is already recorded by a "
                                     "LogitRecorder of another module (a parent or a copy); use that recorder")
                impl = impl[len(PREFIX):]
            if impl not in WRAPPED:
                raise ValueError(
                    f"LogitRecorder: attention module {name!r} ({type(module).__name__}) uses "
                    f"attn_implementation={impl!r}; only {WRAPPED} are recorded (flash and flex kernels never "
                    "form the logits and take their masks in other forms). Switch first, e.g. "
                    "model.set_attn_implementation('sdpa')")
            if impl == "eager":
                base = _eager_default(forward)
                if base is None:
                    raise ValueError(f"LogitRecorder: cannot find the eager attention function that "
                                     f"{type(module).__name__}.forward dispatches to by default")
            else:
                base = forward.__globals__["ALL_ATTENTION_FUNCTIONS"][impl]
            modules[name] = module
            routes[module] = (name, base, impl)
            configs[id(config)] = (config, impl)
        if not modules:
            raise ValueError(f"LogitRecorder: {type(model).__name__} has no attention module dispatching through "
                             "transformers' AttentionInterface (ALL_ATTENTION_FUNCTIONS)")
        return modules, routes, configs

    def _install(self, routes, configs):
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface

        for impl in {impl for _, impl in configs.values()}:
            AttentionInterface.register(PREFIX + impl, _recording_attention)
            AttentionMaskInterface.register(PREFIX + impl, ALL_MASK_ATTENTION_FUNCTIONS[impl])
        me = weakref.ref(self)
        for module, (name, base, impl) in routes.items():
            _ROUTES[module] = _Route(me, name, base, impl)
        for config, impl in configs.values():
            self._restore.append((config, impl))
            # the internal attribute, as PreTrainedModel.set_attn_implementation does, so that sub-configs
            # keep their own implementations
            config._attn_implementation_internal = PREFIX + impl

    def remove(self) -> None:
        """Stop recording: the configs get their implementations back (maxima stay readable)."""
        for config, impl in self._restore:
            if config._attn_implementation == PREFIX + impl:
                config._attn_implementation_internal = impl
        self._restore = []
        for module in self._modules.values():
            route = _ROUTES.get(module)
            if route is not None and route.recorder() is self:
                del _ROUTES[module]
        model = self._model()
        if model is not None and LogitRecorder._live.get(model) is self:
            del LogitRecorder._live[model]

    # -- reading ------------------------------------------------------------------------------------------
    def maxima(self) -> Dict[str, torch.Tensor]:
        """Attention module name → fp32 ``[num_query_heads]`` copy of this rank's max logit per head since the
        last :meth:`reset` (``-inf`` where nothing was recorded), in module order."""
        return {name: m.clone() for name, m in self._maxima.items()}

    def reset(self) -> None:
        for m in self._maxima.values():
            m.fill_(float("-inf"))

    def heads(self, name: str) -> Tuple[int, int, int]:
        """``(num_query_heads, num_kv_heads, head_dim)`` of the attention module ``name``."""
        if name not in self._heads:
            raise KeyError(f"LogitRecorder.heads: {name!r} is not a recorded attention module; "
                           f"recorded: {list(self._heads)}")
        return self._heads[name]

    # -- recording ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def _record(self, name, impl, module, query, key, attention_mask, args, kwargs) -> None:
        q_heads, kv_heads, head_dim = self._heads[name]
        batch, hq, q_len, dim = query.shape
        hkv, k_len = key.shape[1], key.shape[2]
        if (hq, dim) != (q_heads, head_dim) or hq % hkv or key.shape[-1] != dim:
            raise RuntimeError(
                f"LogitRecorder: {name!r} got query {tuple(query.shape)} and key {tuple(key.shape)}, but its "
                f"config says {q_heads} query heads of dim {head_dim} (tensor-parallel heads are not recorded)")
        if args:
            raise RuntimeError(f"LogitRecorder: {name!r} passed attention arguments positionally after the mask; "
                               "transformers' models pass scaling/dropout by keyword")
        scaling = kwargs.get("scaling")
        if scaling is None:
            scaling = dim ** -0.5
        if not isinstance(scaling, torch.Tensor) and not scaling > 0:  # (a tensor is not read back: no sync)
            raise RuntimeError(f"LogitRecorder: {name!r} got scaling={scaling!r}; a positive scale is expected")
        bias = self._bias(attention_mask, k_len)
        causal = False
        if bias is None and impl == "sdpa":
            is_causal = kwargs.get("is_causal")
            if is_causal is None:
                is_causal = getattr(module, "is_causal", True)
            causal = bool(is_causal) and q_len > 1
        groups = hq // hkv
        device_type = query.device.type
        no_autocast = (torch.autocast(device_type=device_type, enabled=False)
                       if torch.amp.is_autocast_available(device_type) else contextlib.nullcontext())
        with no_autocast:
            q = query.detach().float().reshape(batch, hkv, groups, q_len, dim)
            k_t = key.detach().float().transpose(-1, -2)  # [B, Hkv, D, Lk]
            best = torch.full((hkv, groups), float("-inf"), dtype=torch.float32, device=query.device)
            rows = max(1, self._chunk // max(1, batch * hq * k_len))
            if causal:  # blocks of rows, each against only the keys at or before its last row
                rows = min(rows, max(CAUSAL_BLOCK_ROWS, -(-q_len // CAUSAL_BLOCKS)))
            for start in range(0, q_len, rows):
                stop = min(q_len, start + rows)
                r, keys = stop - start, (min(stop, k_len) if causal else k_len)
                # one batched product per key head: its query heads' rows stacked, [B, Hkv, G * r, keys]
                scores = torch.matmul(q[:, :, :, start:stop].reshape(batch, hkv, groups * r, dim), k_t[..., :keys])
                scores = scores.view(batch, hkv, groups, r, keys)
                if bias is not None:
                    part = bias if bias.shape[-2] == 1 else bias[..., start:stop, :]
                    if part.shape[1] == 1:
                        part = part.unsqueeze(2)  # [B, 1, 1, r, Lk]
                    else:
                        part = part.reshape(part.shape[0], hkv, groups, part.shape[-2], part.shape[-1])
                    scores.add_(part)
                elif causal:
                    i = torch.arange(start, stop, device=query.device)[:, None]
                    j = torch.arange(keys, device=query.device)[None, :]
                    scores.add_(torch.where(j > i, float("-inf"), 0.0).to(torch.float32))
                torch.maximum(best, scores.amax(dim=(0, 3, 4)), out=best)
            # max(x·s) = max(x)·s for s > 0, bit for bit (rounding is monotone): one multiply per head
            best.mul_(scaling)
        buffer = self._maxima[name]
        if buffer.device != best.device:  # the model moved after install (or was built on meta: nothing recorded)
            buffer = self._maxima[name] = (torch.full_like(best.reshape(hq), float("-inf")) if buffer.is_meta
                                           else buffer.to(best.device))
        torch.maximum(buffer, best.reshape(hq), out=buffer)

    def _bias(self, mask, key_length):
        """:func:`_additive` of the mask, built once for all the layers that get the same mask tensor."""
        if mask is None:
            return None
        cached = self._bias_cache
        if (cached is not None and cached[0]() is mask and cached[1] == _version(mask) and cached[2] == key_length):
            return cached[3]
        bias = _additive(mask, key_length)
        me = weakref.ref(self)

        def forget(ref, me=me):  # the mask is gone (the forward is over): drop its bias with it
            recorder = me()
            if recorder is not None and recorder._bias_cache is not None and recorder._bias_cache[0] is ref:
                recorder._bias_cache = None

        try:
            self._bias_cache = (weakref.ref(mask, forget), _version(mask), key_length, bias)
        except TypeError:
            self._bias_cache = None
        return bias

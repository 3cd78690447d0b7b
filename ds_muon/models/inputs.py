"""The inputs one traced forward runs on, found the way a person would (:func:`default_inputs`).

A transformers model says what it reads (``config`` and ``main_input_name``).  Any other model is read
from its forward's signature: each argument's name and the config beside it (diffusers-style
``sample_size``/``in_channels``, ``cross_attention_dim``, ``pooled_projection_dim``, ...) give a first
candidate, and one forward on a meta copy checks it.  When that forward fails, the layer that consumed
each input says what it wanted (token ids where an embedding read it, the channels and rank of the conv
stem, the width of the first linear) and the next candidate follows it, until one forward runs; only then
the old guess from the first registered module is returned (its trace fails, and the caller warns)."""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .input_candidates import (_IDS, _NOTHING, SEQ, SPATIAL, _by_name, _candidate, _cfg, _guess,  # noqa: F401
                               _int, _signature)

TRIES = 16  # forwards tried before falling back to the guess from the first registered module


# -- transformers: the config says what the model reads ---------------------------------------------
def default_inputs(model: nn.Module):
    """``(args, kwargs, description)`` for one forward: from a transformers config (``main_input_name``:
    token ids, pixel values at the config's image size and channels, audio), else found from the forward's
    signature by trying candidates on a meta copy (:func:`find_inputs`)."""
    config = getattr(model, "config", None)
    kwargs: Dict[str, Any] = {}
    if config is not None and hasattr(config, "to_dict"):
        main = getattr(model, "main_input_name", "input_ids")
        sub = getattr(config, "vision_config", None) or config
        if main == "pixel_values":
            size = _int(getattr(sub, "image_size", None)) or _int(getattr(config, "image_size", None)) or 224
            ch = _int(getattr(sub, "num_channels", None)) or _int(getattr(config, "num_channels", None)) or 3
            kwargs[main] = torch.zeros(1, ch, size, size)
        elif main == "input_values":
            kwargs[main] = torch.zeros(1, 16000)
        elif main == "input_features":
            kwargs[main] = _features(model, config)
        elif main == "input_ids":
            kwargs[main] = torch.zeros(1, SEQ, dtype=torch.long)
        else:
            raise LookupError(f"no example for main_input_name={main!r}: pass example_inputs=")
        params = _forward_params(model)
        if "decoder_input_ids" in params and main != "decoder_input_ids":
            kwargs["decoder_input_ids"] = torch.zeros(1, SEQ, dtype=torch.long)
        if "use_cache" in params or "kwargs" in params:
            kwargs["use_cache"] = False
        _required(model, kwargs)
        return (), kwargs, f"{main} from the config"
    return find_inputs(model)


def _required(model, kwargs: Dict[str, Any]) -> None:
    """Arguments the forward requires beside its main input (token ids a vision-language model also reads,
    a mask, a time), by name as :func:`_by_name` reads them; left out where no name says what they are."""
    for p in _signature(model):
        if p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or \
                p.name in kwargs:
            continue
        v = torch.zeros(1, SEQ, dtype=torch.long) if p.name in _IDS else _by_name(p.name, list(kwargs.items()), None)
        if v is not _NOTHING:
            kwargs[p.name] = v


def _features(model, config) -> torch.Tensor:
    """Audio features: ``[1, mel bins, frames]`` where a conv reads the bins as channels (Whisper, at
    twice its ``max_source_positions`` frames), else ``[1, frames, features]``."""
    subs = [config] + [v for v in vars(config).values() if hasattr(v, "to_dict")]
    mel = frames = None
    for c in subs:
        mel = mel or next((_int(getattr(c, k, None)) for k in ("num_mel_bins", "feature_size", "input_feat_per_channel",
                                                              "input_dim") if _int(getattr(c, k, None))), None)
        frames = frames or _int(getattr(c, "max_source_positions", None))
    if mel is None:
        raise LookupError("no feature width in the config: pass example_inputs=")
    frames = 2 * frames if frames else 32
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv1d)), None)
    if conv is not None and conv.in_channels == mel:
        return torch.zeros(1, mel, frames)
    return torch.zeros(1, frames, mel)


def _forward_params(model) -> Set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


# -- any other model: the signature, the config beside it, and one forward per candidate ------------
# -- trying a candidate ------------------------------------------------------------------------------
_PASS = {"view", "reshape", "permute", "transpose", "contiguous", "clone", "flatten", "unflatten", "squeeze",
         "unsqueeze", "to", "type", "float", "half", "bfloat16", "double", "detach", "movedim", "__get__",
         "size", "dim", "shape"}


class _Consumers(TorchFunctionMode):
    """Watches which layer first consumes each input (through views and casts): an embedding, a linear
    (its width), a conv (its channels and rank); fakes data-dependent reads as the trace does."""

    def __init__(self, inputs: Dict[int, str], params: Set[int]):
        super().__init__()
        self.alias = dict(inputs)  # id(tensor) -> input name
        self.params = params
        self.keep: List[torch.Tensor] = []
        self.seen: Dict[str, Tuple[str, Tuple[int, ...], int]] = {}  # name -> (op, weight shape, groups)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from .meta import _SCALARS, _fake_scalar, _name

        kwargs = kwargs or {}
        name = _name(func)
        if name in _SCALARS and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta":
            return _fake_scalar(name, args[0])
        self.same = None
        try:
            src = self._consumer(name, args, kwargs)
        except Exception:  # noqa: BLE001 - watching never breaks the forward
            src = None
        out = func(*args, **kwargs)  # after the consumer is noted: a consumer fed the wrong input raises
        if src is not None and isinstance(out, torch.Tensor) and (self.same is None or tuple(out.shape) == self.same):
            self.alias[id(out)] = src
            self.keep.append(out)
        return out

    def _consumer(self, name, args, kwargs) -> Optional[str]:
        """Note the layer ``func`` applies to an input (its first); return the input's name where ``func``
        only passes it on (a view, a cast)."""
        flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        mine = [self.alias[id(a)] for a in flat if id(a) in self.alias]
        if not mine:
            return None
        src = mine[0]
        if name in _PASS:
            return src
        if src in self.seen:
            return None
        w = next((a for a in flat if id(a) in self.params), None)
        op = ("embedding" if name in ("embedding", "embedding_bag") else
              "conv" if name.startswith("conv") and "transpose" not in name else
              "linear" if name in ("linear", "matmul", "__matmul__", "mm", "addmm", "bmm") else None)
        if op is None:  # a norm, an activation, a scale (the shape kept): the input passes on to its consumer
            self.same = tuple(flat[0].shape) if len(set(mine)) == 1 and len(flat) - len(mine) <= 2 else None
            return src if self.same is not None else None
        if w is None:
            return None
        groups = int(args[6] if len(args) > 6 else kwargs.get("groups", 1)) if op == "conv" else 1
        self.seen[src] = (op, tuple(w.shape), groups)
        return None


def _try(shadow: nn.Module, pos, kw):
    """Run ``shadow`` (a meta copy) on the candidate: ``(error or "", consumers)``."""
    from .meta import _to_meta, all_nonzero

    args = tuple(_to_meta(v) for _, v in pos)
    kwargs = _to_meta(kw)
    names = {id(t): n for n, t in list(zip([n for n, _ in pos], args)) + list(kwargs.items())
             if isinstance(t, torch.Tensor)}
    mode = _Consumers(names, {id(p) for p in shadow.parameters()})
    try:
        with torch.no_grad(), all_nonzero(), mode:
            shadow(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the next candidate follows what the layers wanted
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}", mode.seen
    return "", mode.seen


def _follow(value, seen) -> Any:
    """The input a consumer wanted, where ``value`` does not fit it (None: it fits, or nothing to follow)."""
    if not isinstance(value, torch.Tensor) or seen is None:
        return None
    op, shape, groups = seen
    if op == "embedding":
        if value.is_floating_point():
            return torch.zeros(*(value.shape[:2] if value.ndim == 3 else value.shape[:1] + (SEQ,)), dtype=torch.long)
        return None
    if op == "linear" and len(shape) == 2 and value.ndim >= 2:
        width = shape[1]
        if value.is_floating_point() and value.ndim >= 2 and value.shape[-1] == width:
            return None
        if value.is_floating_point() and 2 <= value.ndim <= 3:
            return torch.zeros(*value.shape[:-1], width)
        return torch.zeros(1, SEQ, width)
    if op == "conv" and len(shape) >= 3:
        ch, rank = shape[1] * groups, len(shape) - 2
        if value.is_floating_point() and value.ndim == rank + 2 and value.shape[1] == ch:
            return None
        side = max(SPATIAL, *shape[2:])
        return torch.zeros(1, ch, *([side] * rank))
    return None


def find_inputs(model: nn.Module):
    """``(args, kwargs, description)``: the first candidate from the forward's signature, each failed forward
    followed by the inputs its consumers wanted (:func:`_follow`); when that changes nothing, the data with
    one more axis (video latents: frames after or before the channels).  At most :data:`TRIES` forwards on
    one meta copy; when none runs, the guess from the first registered module (:func:`_guess`)."""
    from .meta import meta_copy

    try:
        pos, kw = _candidate(model)
    except Exception:  # noqa: BLE001 - a signature or config we cannot read: the old guess
        return _guess(model)
    if any(v is None for _, v in pos):
        missing = [n for n, v in pos if v is None]
        try:
            return _fallback(model, f"no example for {', '.join(missing)}")
        except LookupError:
            raise LookupError(f"no example for the forward's {', '.join(missing)}: pass example_inputs=") from None
    shadow = meta_copy(model)
    shadow.eval()
    queue = [(pos, kw)] + _wider(pos, kw) + _masked(model, pos, kw) + _config_sized(model, pos, kw)
    last, tries = "", 0
    while queue and tries < TRIES:
        pos, kw = queue.pop(0)
        pos, kw = list(pos), dict(kw)
        while tries < TRIES:
            tries += 1
            err, seen = _try(shadow, pos, kw)
            if not err:
                return tuple(v for _, v in pos), kw, _describe(pos, kw, tries)
            last = last or err
            changed = False
            for i, (n, v) in enumerate(pos):
                new = _follow(v, seen.get(n))
                if new is not None:
                    pos[i], changed = (n, new), True
            for n, v in list(kw.items()):
                new = _follow(v, seen.get(n))
                if new is not None:
                    kw[n], changed = new, True
            if not changed:
                break
    return _fallback(model, last)


def _wider(pos, kw) -> List[Tuple[list, dict]]:
    """The candidate with its data (the first float tensor of 3+ dims) given one more axis of 2: after the
    channels (``[B, C, F, H, W]``) and before them (``[B, F, C, H, W]``); arguments shaped like the data
    follow it."""
    i = next((i for i, (_, v) in enumerate(pos) if isinstance(v, torch.Tensor) and v.is_floating_point()
              and v.ndim >= 3), None)
    if i is None:
        return []
    data = pos[i][1]
    out = []
    for at in (2, 1):
        shape = list(data.shape)
        shape.insert(at, 2)
        new = torch.zeros(shape)
        out.append(([(n, new if isinstance(v, torch.Tensor) and v.shape == data.shape else v) for n, v in pos],
                    {n: (new if isinstance(v, torch.Tensor) and v.shape == data.shape else v) for n, v in kw.items()}))
    return out


def _masked(model, pos, kw) -> List[Tuple[list, dict]]:
    """The candidate with the optional masks of the context filled (a forward that reads
    ``encoder_attention_mask`` though its default is None)."""
    names = [p.name for p in _signature(model) if p.default is not inspect.Parameter.empty and "mask" in p.name
             and ("encoder" in p.name or "text" in p.name or "context" in p.name) and p.name not in kw]
    if not names:
        return []
    return [(list(pos), {**kw, **{n: torch.ones(1, SEQ, dtype=torch.bool) for n in names}})]


def _config_sized(model, pos, kw) -> List[Tuple[list, dict]]:
    """The candidate with its data at the config's own size (``sample_size``, or ``sample_height`` and
    ``sample_width``, ``sample_frames``): models whose position tables fix the input's size."""
    cfg = _cfg(model)
    i = next((i for i, (_, v) in enumerate(pos) if isinstance(v, torch.Tensor) and v.is_floating_point()
              and v.ndim >= 4), None)
    if i is None:
        return []
    size = cfg.get("sample_size")
    hw = ([_int(size)] * 2 if _int(size) else list(size) if isinstance(size, (list, tuple)) and len(size) == 2
          else [_int(cfg.get("sample_height")), _int(cfg.get("sample_width"))])
    if not all(hw):
        return []
    data = pos[i][1]
    out = []
    shapes = [list(data.shape[:-2]) + hw]
    frames = _int(cfg.get("sample_frames"))
    if frames:
        t = _int(cfg.get("temporal_compression_ratio")) or 1
        f = (frames - 1) // t + 1
        shapes += [[1, f, data.shape[1]] + hw, [1, data.shape[1], f] + hw]
    for shape in shapes:
        new = torch.zeros(shape)
        out.append(([(n, new if v is data else v) for n, v in pos], dict(kw)))
    return out


def _fallback(model, why: str):
    args, kwargs, what = _guess(model)
    return args, kwargs, f"{what} (guessed from the first layer; no candidate from the signature ran: {why})"


def _describe(pos, kw, tries: int) -> str:
    def one(n, v):
        if isinstance(v, torch.Tensor):
            kind = "ids" if not v.is_floating_point() else "x".join(str(d) for d in v.shape)
            return f"{n} ({kind})"
        if isinstance(v, dict):
            return f"{n} ({', '.join(v)})"
        return n
    parts = [one(n, v) for n, v in pos] + [one(n, v) for n, v in kw.items()]
    return f"{', '.join(parts)} from the forward's signature ({tries} forward{'s' if tries > 1 else ''} tried)"

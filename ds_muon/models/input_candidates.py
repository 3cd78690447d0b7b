"""A first candidate for each argument of a forward, from its signature and the config beside it (diffusers'
``sample_size``/``in_channels``, ``cross_attention_dim``, ``pooled_projection_dim``, litgpt's ``idx``, ...):
what :func:`.inputs.find_inputs` tries first.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

SEQ = 8  # the default example sequence
SPATIAL = 16  # the default side of an example image or latent (small: the trace's companions stay read)


def _int(v) -> Optional[int]:
    if isinstance(v, (list, tuple)) and v:
        v = v[0]
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


_IDS = {"input_ids", "idx", "ids", "tokens", "token_ids", "decoder_input_ids", "input_tokens", "decoder_input_tokens"}
_DATA = {"x", "input", "inputs", "sample", "hidden_states", "pixel_values", "images", "image", "img", "latents",
         "latent", "z", "noisy_latents", "mel", "audio", "waveform", "inputs_embeds", "features", "data"}
_TIME = {"timestep", "timesteps", "t", "timestep_ratio", "noise_level", "sigma", "sigmas", "time", "times",
         "decoder_noise_time", "noise_time"}
_CONTEXT = {"encoder_hidden_states", "context", "cap_feats", "prompt_embeds", "text_embeds", "text_hidden_states",
            "encoder_hidden_states_t5", "clip_text", "cond", "condition"}
_POOLED = {"pooled_projections", "pooled_embeds", "pooled_text_emb", "clip_text_pooled", "pooled_prompt_embeds",
           "global_hidden_states", "y"}
_POSITIONS = {"img_ids", "txt_ids"}
_CHANNELS = ("in_channels", "num_channels", "latent_channels", "in_chans", "input_channels", "channels", "in_dim")
_CONTEXT_DIMS = ("encoder_hid_dim", "joint_attention_dim", "caption_channels", "cross_attention_dim", "text_dim",
                 "text_embed_dim", "context_dim", "caption_dim", "cap_feat_dim", "encoder_dim", "text_hidden_dim")
_POOLED_DIMS = ("pooled_projection_dim", "pooled_embed_dim", "text_embed_dim", "pooled_text_dim", "global_states_input_dim")


def _cfg(model) -> Dict[str, Any]:
    """The model's configuration as a plain dict: diffusers' ``config`` (a FrozenDict), a dataclass config
    (litgpt), else empty."""
    c = getattr(model, "config", None)
    if isinstance(c, dict):
        return dict(c)
    if c is not None and hasattr(c, "__dict__"):
        return {k: v for k, v in vars(c).items() if not k.startswith("_")}
    return {}


def _first(cfg: Dict[str, Any], keys) -> Optional[int]:
    return next((_int(cfg.get(k)) for k in keys if _int(cfg.get(k))), None)


def _signature(model) -> List[inspect.Parameter]:
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return []
    return params


def _stem_rank(model) -> Optional[int]:
    """The rank of the first conv (2 for ``Conv2d``): the rank of the images or latents the model reads."""
    conv = next((m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
    return len(conv.kernel_size) if conv is not None else None


def _data(model, cfg: Dict[str, Any]) -> torch.Tensor:
    """The first candidate for the data argument: an image or latent at the config's channels (and the
    stem's rank) where the config or a conv says so, else features of the first linear's width."""
    ch = _first(cfg, _CHANNELS)
    rank = _stem_rank(model)
    patch = _int(cfg.get("patch_size")) or 1
    if ch is not None and (rank is not None or "sample_size" in cfg or "patch_size" in cfg):
        side = max(SPATIAL, 4 * patch)
        return torch.zeros(1, ch, *([side] * (rank or 2)))
    if ch is not None:
        return torch.zeros(1, SEQ, ch)
    return _guess(model)[0][0]


def _candidate(model) -> Tuple[List[Tuple[str, Any]], Dict[str, Any]]:
    """The first candidate from the signature: ``(positional [(name, value)], keyword {name: value})``;
    a required argument with no example is ``(name, None)``."""
    cfg = _cfg(model)
    params = _signature(model)
    pos: List[Tuple[str, Any]] = []
    kw: Dict[str, Any] = {}
    if not params or all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return [("input", _guess(model)[0][0])], {}
    ctx = _first(cfg, _CONTEXT_DIMS)
    pooled = _first(cfg, _POOLED_DIMS)
    data_done = False
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        n, required = p.name, p.default is inspect.Parameter.empty
        v: Any = _NOTHING
        if n in _IDS and (required or not data_done):
            v, data_done = torch.zeros(1, SEQ, dtype=torch.long), True
        elif n in _DATA and not data_done:
            v, data_done = _data(model, cfg), True
        elif n in _TIME:
            v = torch.ones(1)
        elif n in _CONTEXT:
            v = torch.zeros(1, SEQ, ctx or 32)
        elif n in _POOLED and (required or pooled):
            v = torch.zeros(1, pooled or 32)
        elif n in _POSITIONS:
            axes = cfg.get("axes_dims_rope")
            v = torch.zeros(SEQ, len(axes) if isinstance(axes, (list, tuple)) else 3)
        elif n == "guidance" and cfg.get("guidance_embeds"):
            v = torch.ones(1)
        elif n == "class_labels" and (cfg.get("num_class_embeds") or cfg.get("num_embeds_ada_norm")):
            v = torch.zeros(1, dtype=torch.long)
        elif n == "added_cond_kwargs":
            v = _added_cond(cfg)
        elif required and not data_done:  # an argument of any other name in first place: the data
            v, data_done = _data(model, cfg), True
        elif required:
            v = _by_name(n, pos, ctx, cfg)
        if v is _NOTHING:
            if required:
                pos.append((n, None))
            continue
        if required and p.kind != p.KEYWORD_ONLY:  # required positionals come first, in order
            pos.append((n, v))
        else:
            kw[n] = v
    return pos, kw


_NOTHING = object()


def _by_name(n: str, pos, ctx, cfg=None) -> Any:
    """A required argument of a name no table holds, read as a person would: a mask (of the context's
    length), a time or scale, a size or crop pair, else a tensor like the data (a control image, image
    latents: the consumers then correct it)."""
    low = n.lower()
    if "mask" in low:
        return torch.ones(1, SEQ, dtype=torch.bool)
    if "time" in low or low in ("fps", "scale", "r", "t_r") or low.endswith(("_t", "_r")):
        return torch.ones(1)
    if low.endswith(("_size", "_coords", "_crop")):
        return torch.full((1, 2), float(SPATIAL))
    data = next((v for _, v in pos if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
    cc = _int((cfg or {}).get("conditioning_channels"))
    if "cond" in low and cc and data is not None and data.ndim >= 3:  # a ControlNet's image: pixels, 8x the latent
        return torch.zeros(1, cc, *[8 * d for d in data.shape[2:]])
    if ("cond" in low or "latent" in low or "embed" in low or "image" in low) and data is not None:
        return torch.zeros_like(data)
    return _NOTHING


def _added_cond(cfg: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """diffusers' ``added_cond_kwargs``: SDXL's text embeds and six time ids, PixArt's resolution and
    aspect ratio (each read only where the config enables it)."""
    out: Dict[str, torch.Tensor] = {"resolution": torch.zeros(1, 2), "aspect_ratio": torch.zeros(1, 1)}
    t = _int(cfg.get("addition_time_embed_dim"))
    proj = _int(cfg.get("projection_class_embeddings_input_dim"))
    if cfg.get("addition_embed_type") == "text_time" and t and proj:
        out["text_embeds"] = torch.zeros(1, proj - 6 * t)
        out["time_ids"] = torch.zeros(1, 6)
    elif cfg.get("addition_embed_type") in ("text", "text_image", "image", "image_hint"):
        d = _first(cfg, ("encoder_hid_dim", "cross_attention_dim")) or 32
        out.update(text_embeds=torch.zeros(1, SEQ, d), image_embeds=torch.zeros(1, d), hint=torch.zeros(1, 3, 64, 64))
    return out


def _guess(model: nn.Module):
    size = None
    for m in model.modules():  # timm's PatchEmbed keeps img_size
        s = getattr(m, "img_size", None) or getattr(m, "image_size", None)
        if s is not None:
            size = _int(s)
            break
    for m in model.modules():
        if isinstance(m, nn.modules.conv._ConvNd):
            d = len(m.kernel_size)
            n = size or (64 if d == 2 else 32)
            return (torch.zeros(1, m.in_channels, *([n] * d)),), {}, f"a {d + 2}-D input of {m.in_channels} channels"
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            return (torch.zeros(1, SEQ, dtype=torch.long),), {}, "token ids"
        if isinstance(m, nn.Linear):
            return (torch.zeros(1, SEQ, m.in_features),), {}, f"features of width {m.in_features}"
    raise LookupError("no conv, embedding or linear to guess an input from: pass example_inputs=")

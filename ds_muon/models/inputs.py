"""The inputs one traced forward runs on, found the way a person would (see :func:`default_inputs`).

Kept apart from :mod:`ds_muon.models.trace` (which reads what the forward does) because finding inputs
is its own job: read the config, the forward's signature and the first layers that consume them."""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Set

import torch
from torch import nn

SEQ = 8  # the default example sequence


def _int(v) -> Optional[int]:
    if isinstance(v, (list, tuple)) and v:
        v = v[0]
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def default_inputs(model: nn.Module):
    """``(args, kwargs, description)`` for one forward: from the config (``main_input_name``: token ids,
    pixel values at the config's image size and channels, audio), else a guess from the first layer
    (an image for a conv stem or a patch embedding with ``img_size``, token ids for an embedding, hidden
    features for a linear)."""
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
        return (), kwargs, f"{main} from the config"
    return _guess(model)


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

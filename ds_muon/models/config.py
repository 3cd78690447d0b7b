"""The config, one evidence: what a model's config says about its tensors: expert counts, label counts,
vocabularies, input channels.  Read from the config and every sub-config (``text_config``, ``vision_config``,
…), whatever each family calls the field, so a new family is read without a new rule.
"""

from __future__ import annotations

from typing import Iterator, Set



def configs_in(root) -> list:
    """A model's config (``model.config``) and every config nested in it (multimodal towers), once each."""
    out, seen = [], set()

    def walk(c, depth=0):
        if c is None or id(c) in seen or depth > 4:
            return
        seen.add(id(c))
        out.append(c)
        for v in list(vars(c).values()) if hasattr(c, "__dict__") else ():
            if _is_config(v):
                walk(v, depth + 1)
            elif isinstance(v, (list, tuple)):
                for x in v:
                    if _is_config(x):
                        walk(x, depth + 1)

    if _is_config(root):
        walk(root)
    return out


def _is_config(v) -> bool:
    return hasattr(v, "to_dict") and hasattr(v, "model_type")


def _ints(configs, accept) -> Set[int]:
    out: Set[int] = set()
    for c in configs:
        for k, v in _fields(c):
            if accept(k) and isinstance(v, int) and not isinstance(v, bool) and v > 1:
                out.add(v)
    return out


def _fields(c) -> Iterator:
    for k, v in vars(c).items():
        if not isinstance(k, str):
            continue
        yield k, v
        if isinstance(v, dict):  # DBRX keeps its MoE sizes in ffn_config (a dict or a config)
            for k2, v2 in v.items():
                if isinstance(k2, str):
                    yield k2, v2


def expert_counts(configs) -> Set[int]:
    """How many routed experts a layer has: any field named ``…experts`` (``num_experts``,
    ``num_local_experts``, ``n_routed_experts``, ``moe_num_experts``), shared experts excluded."""
    return _ints(configs, lambda k: k.endswith("experts") and "shared" not in k and "per_tok" not in k)


def label_counts(configs) -> Set[int]:
    """Outputs of a classification / QA / score head: ``num_labels`` (a QA head: 2; a score head: 1)."""
    out: Set[int] = set()
    for c in configs:
        n = getattr(c, "num_labels", None)
        if isinstance(n, int):
            out.update({n, n + 1})  # detection heads add a no-object class
    return out | {1, 2}


def vocab_sizes(configs) -> Set[int]:
    return _ints(configs, lambda k: k.endswith("vocab_size") or k == "n_vocab")


def input_widths(configs) -> Set[int]:
    """Widths of the raw input a first layer reads: pixel channels (and pixel patches), mel bins,
    audio or time-series features.  A conv or linear reading one of these is an input layer.
    Empty for a model without a config (nothing says what its input is)."""
    if not configs:
        return set()
    chans = _ints(configs, lambda k: k in ("num_channels", "in_channels", "input_channels", "num_mel_bins",
                                            "image_channels", "num_input_channels", "input_dim"))
    patches = _ints(configs, lambda k: k in ("patch_size", "spatial_patch_size"))
    temporal = _ints(configs, lambda k: k in ("temporal_patch_size", "tubelet_size")) | {1}
    out = set(chans) | {1}
    for c in chans:
        for p in patches:
            for t in temporal:
                out.add(c * p * p * t)
    return out



class ConfigFacts:
    """What a model's config says about its sizes: expert counts, labels, vocabularies, input widths (read
    from the config and every config nested in it)."""

    def __init__(self, root_config):
        configs = configs_in(root_config)
        self.config = configs[0] if configs else None
        self.experts = expert_counts(configs)
        self.labels = label_counts(configs)
        self.vocab = vocab_sizes(configs)
        self.widths = input_widths(configs)

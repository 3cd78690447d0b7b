"""What each tensor of a model is, read from its modules, its config and its fused projections.

* :mod:`.trace` — what the forward does with each parameter, read once on a meta copy of the model
  (consuming ops, input layers, heads, how each output is split); :mod:`.wrappers` — the module behind
  DDP, ``torch.compile``, PEFT, DeepSpeed's engine, so the wrapper cannot change a decision;
* :mod:`.meta` — the model's meta copy and what a meta forward needs (shared by the trace and the input search);
* :mod:`.equations` — which matrix an ``einsum``/``tensordot`` applies with a parameter (in, out and stack axes);
* :mod:`.kinds` — one decision per tensor (kind, Muon or AdamW, why, its blocks) from module semantics
  and the model's ends; :mod:`.config` — expert counts and head layouts from the config;
* :mod:`.fused` — fused projections' blocks (q|k|v, gate|up, interleaved heads), keyed by module class;
* :mod:`.experts` — fused MoE expert stacks and routers;
* :mod:`.selection` — the entry point over a model (names only as a fallback);
* :mod:`.tags` — the tagging functions (``split_rows``, ``tensor_parallel``, ``expert_weight``, ``domain``,
  ``transposed``, ``fused_blocks``) that say it in the engine's vocabulary (:mod:`ds_muon.tensors.tag_keys`);
* :mod:`.attention_logits` — ``LogitRecorder``: each attention head's largest pre-softmax logit (S_max, for
  QK-clip), recorded through transformers' attention-function registry (eager and SDPA).
"""

from .decide import PRECEDENCE
from .evidence import Rules
from .reading import classify, model_map, read
from .kinds import KINDS, MUON_KINDS, Decision

__all__ = ["KINDS", "MUON_KINDS", "Decision", "PRECEDENCE", "Rules", "classify", "model_map", "read"]

"""What each tensor of a model is: evidence that only reports what it saw, then one decision.

The evidence, each module reporting one kind of it:

* :mod:`.module_types` — what each module is (linear, conv, depthwise, embedding, recurrent, fused experts and
  the routers beside them, torch's parametrizations, PEFT's adapters, the module behind a wrapper) and the
  model's own API for its ends (``get_input_embeddings()``, ``get_output_embeddings()``, ``base_model``);
* :mod:`.config` — what the config says of sizes: expert counts, labels, vocabularies, input widths;
* :mod:`.trace` — what the forward does with each tensor, read once on a meta model (:mod:`.meta` makes the
  copy, :mod:`.inputs` and :mod:`.input_candidates` find the inputs, :mod:`.recorder` is the mode that
  follows every tensor, :mod:`.equations` reads what an ``einsum``/``tensordot`` applies);
* :mod:`.names` — names, the fallback (``head_names``, norms, the wrappers' name prefixes);
* :mod:`.blocks` — the blocks a matrix is split into, from the config (readers in :mod:`.fused`) or the
  forward; :mod:`.experts` — fused expert stacks, per expert.

Then :mod:`.evidence` gathers one model's evidence (:class:`~.evidence.Rules`) and views one tensor through
it; :mod:`.decide` walks :data:`~.decide.PRECEDENCE` once per tensor (the first rule that applies decides,
in the closed list of :mod:`.kinds`); :mod:`.reading` reads a whole model once (the entry every path calls).
:mod:`.tags` says the decisions in the engine's vocabulary (``split_rows``, ``tensor_parallel``,
``expert_weight``, ``domain``, ``transposed``, ``fused_blocks``; the keys on the ground floor,
:mod:`ds_muon.tensors.tag_keys`); :mod:`.attention_logits` records each head's largest pre-softmax logit for
QK-clip.  Imports: :mod:`ds_muon.tensors` only; the stacks hand this package original names and shapes.
"""

from .decide import PRECEDENCE
from .evidence import Rules
from .kinds import KINDS, MUON_KINDS, Decision
from .reading import classify, model_map, read

__all__ = ["KINDS", "MUON_KINDS", "Decision", "PRECEDENCE", "Rules", "classify", "model_map", "read"]

"""The rules: the maths of a Muon step, as pure functions of tensors.

No process groups, no models, no stacks: the engine hands a rule the tensors a home rank or a holder
already has, so a rule runs the same on every stack and its results are bitwise the same wherever the
matrix lives.  A new rule is one file here.

* :mod:`.newton_schulz` — the orthogonalization (methods, stacks batched by shape), with
  :mod:`.ns_coefficients` (the coefficient schedules), :mod:`.ns_kernels` (which kernel forms its products
  run as on this machine, same bits) and :mod:`.ns_auto` (what ``ns_dtype``/``ns_method="auto"`` become on
  this device, decided once per process);
* :mod:`.update` — the NS input (decay, momentum, Nesterov) and the apply on a piece of the weight;
* :mod:`.adamw` — AdamW, for every tensor Muon does not orthogonalize (torch's functional AdamW, bitwise);
* :mod:`.scaling` — the update's scale per matrix shape;
* :mod:`.decay` — the weight decay modes (decoupled, l2, independent, cautious) on Muon and AdamW tensors;
* :mod:`.normuon` — NorMuon (``variant="normuon"``): a per-neuron second moment of the NS result;
* :mod:`.qk_clip` — QK-clip (MuonClip): gamma per head from the maxima, which output features are which head's
  (separate, fused, MLA projections), the q/k row factors (GQA, MLA).
"""

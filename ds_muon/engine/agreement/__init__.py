"""Agreement: what must hold on every rank before a step writes anything.

* :mod:`.settings` — param groups: defaults, where each key acts, every setting's validation;
* :mod:`.state_check` — state tensors that do not fit their parameter, refused at load and before the step;
* :mod:`.check` — the step's one small all_reduce (:class:`~.check.Agreement`): gradients present and
  finite, copies equal, settings equal, one rank's local failure raised on every rank
  (:class:`~.check.LocalFailure`); with :mod:`.identity` (which optimizer steps what) and
  :mod:`.extremes` (per-tensor min/max, the fingerprints);
* :mod:`.timeouts` — process groups ds_muon makes keep the timeout of the group they stand for.

Imports: :mod:`~ds_muon.engine.exchange`, :mod:`~ds_muon.engine.memory` and :mod:`ds_muon.rules` only.
"""

from ..moved import forward_names

__getattr__ = forward_names(__name__, "ds_muon.engine.agreement", "ds_muon.engine.agreement.check")

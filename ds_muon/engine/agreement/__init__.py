"""Agreement: what must hold on every rank before a step writes anything.

* :mod:`.settings` — param groups: defaults, where each key acts, every setting's validation;
* :mod:`.state_check` — state tensors that do not fit their parameter, refused at load and before the step;
* :mod:`.check` — the step's one small all_reduce (:class:`~.check.Agreement`): gradients present and
  finite, copies equal, settings equal, with :mod:`.identity` (which optimizer steps what) and
  :mod:`.extremes` (per-tensor min/max); its table (:mod:`.table`: columns, rows written on the device,
  one code per row for the host) and what it compares (:mod:`.fingerprints`: hashes of the extremes and
  of the settings, and the first setting that differs);
* :mod:`.local_failure` — one rank's failed local check raised on every rank (:class:`~.local_failure.LocalFailure`);
* :mod:`.timeouts` — process groups ds_muon makes keep the timeout of the group they stand for.

Imports: :mod:`~ds_muon.engine.exchange`, :mod:`~ds_muon.engine.memory` and :mod:`ds_muon.rules` only.
"""

from ..moved import forward_names

__getattr__ = forward_names(__name__, "ds_muon.engine.agreement", *(f"{__name__}.{m}" for m in (
    "fingerprints", "table", "local_failure", "check")))

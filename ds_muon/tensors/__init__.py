"""What a tensor says about itself, wherever a stack keeps it: the ground floor every room reads.

* :mod:`.shape` — a parameter's shape in the model (ZeRO-3's ``ds_shape``, a DTensor's global shape) and
  the ``[rows, cols]`` matrix Muon orthogonalizes of it;
* :mod:`.tag_keys` — the attributes ds_muon's tags set on a tensor, and their readers.

The model readers (:mod:`ds_muon.models`) write tags and read shapes; the engine and the stack adapters
read them.  Keeping both here lets neither depend on the other.  Imports: nothing of ds_muon.
"""

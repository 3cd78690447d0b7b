"""One adapter per training stack; each only *describes* where shards live.

An adapter (:class:`~ds_muon.integrations.base.StackAdapter`) maps one tensor the
optimizer steps to a :class:`~ds_muon.layout.ParamBinding`:

* :mod:`.local` — no wrapper or DDP (every rank holds every matrix), and
  tensor-parallel shards;
* :mod:`.fsdp1` — ``FullyShardedDataParallel`` flat parameters and the original
  tensors in them; :mod:`.fsdp2` — ``fully_shard`` DTensors;
* :mod:`.deepspeed` — ZeRO's flat fp32 partitions, attached after
  ``deepspeed.initialize`` by :func:`~ds_muon.integrations.deepspeed.bind`;
* :mod:`.moe` — expert data-parallel domains (tags every adapter reads).

:class:`~ds_muon.integrations.default.DefaultAdapter`, which a ``Muon`` uses unless
given another, picks local, FSDP1 or FSDP2 per tensor.  :mod:`.fsdp` is the FSDP
front door (param groups for a wrapped model).
"""

"""One adapter per training stack; each only *describes* where shards live.

An adapter (:class:`~ds_muon.integrations.base.StackAdapter`) maps one tensor the
optimizer steps to a :class:`~ds_muon.engine.exchange.layout.ParamBinding`:

* :mod:`.local` — no wrapper or DDP (every rank holds every matrix), and
  tensor-parallel shards;
* :mod:`.fsdp1` — ``FullyShardedDataParallel`` flat parameters and the original
  tensors in them, with :mod:`.fsdp1_checkpoint` (full optimizer state dicts whose keys
  torch's CPU offload overwrote, refused at load); :mod:`.fsdp2` — ``fully_shard`` DTensors;
* :mod:`.deepspeed` — ZeRO's flat fp32 partitions (attached after
  ``deepspeed.initialize`` by the front door :func:`ds_muon.deepspeed.bind`), with
  :mod:`.deepspeed_checkpoint` (checkpoints refused before anything loads),
  :mod:`.deepspeed_universal` (DeepSpeed's universal layout over every state key) and
  :mod:`.deepspeed_cpu_adam` (DeepSpeed's CPU Adam for offloaded AdamW);
* :mod:`.moe` — expert data-parallel domains (tags every adapter reads);
* :mod:`.named_pieces` — this rank's pieces of the model's tensors by their names, on every stack (QK-clip).

:class:`~ds_muon.integrations.default.DefaultAdapter`, which a ``Muon`` uses unless
given another, picks local, FSDP1 or FSDP2 per tensor.  A new stack is one file here.
"""

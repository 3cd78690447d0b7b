"""ds_muon under PyTorch Lightning at W=2 (gloo), each strategy bitwise against ds_muon in one process.

One spawned pair of ranks runs every set-up in turn (Lightning's start-up is the cost):

* Fabric: ``strategy="ddp"``, ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` per layer) and
  ``ds_muon.lightning.FabricDeepSpeedStrategy`` (ZeRO-2); ``fabric.save`` after K steps, K more
  steps; a fresh model (other seed) + ``fabric.load`` + the same K steps.
* Trainer: ``configure_optimizers`` returning ``ds_muon.Muon(ds_muon.muon_param_groups(self))`` under
  ``strategy="ddp"``, ``ModelParallelStrategy`` (FSDP2 in ``configure_model``) and
  ``ds_muon.lightning.DeepSpeedStrategy`` (ZeRO-2 with the Muon, ZeRO-3 with a ``"type": "DsMuon"``
  config entry); ``trainer.save_checkpoint`` after K steps (that run held to K steps in one process)
  and, with a fresh module (other seed), ``fit(ckpt_path=...)`` to 2K.
* Lightning's own DeepSpeed strategy (its CUDA check lifted, as ds_muon's strategy lifts it on CPU)
  with a Muon from ``configure_optimizers``: unbound, it must refuse to step on every rank.

Every rank sees the same batches, so the averaged gradient is bitwise the one-process gradient and
every run (straight and resumed) must end on the one-process weights with ``torch.equal``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lightning")

import dist_harness  # noqa: E402
from door_matrix import full_weights  # noqa: E402  (every weight whole in fp32 by the plain names)

ENV = {"DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
       "PL_DISABLE_FORK": "1"}
K = 2  # steps before and after the checkpoint
SETTINGS = dict(lr=0.02, adam_lr=3e-3)
MUON_KW = dict(ns_dtype=torch.float32, log_summary=False)


class Net(torch.nn.Module):
    """Embedding (AdamW) -> two hidden linears (Muon) -> head (AdamW), with norms and biases."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 16))
            for _ in range(2))
        self.head = torch.nn.Linear(16, 32, bias=False)

    def get_output_embeddings(self):
        return self.head

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def tokens(step: int) -> torch.Tensor:
    """The batch of optimizer step ``step``: the same on every rank."""
    return torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1000 + step))


def reference(steps: int = 2 * K) -> dict:
    """ds_muon.Muon in one process on one thread over ``steps`` batches."""
    import ds_muon

    with dist_harness.one_thread():
        net = make_net()
        opt = ds_muon.Muon(ds_muon.muon_param_groups(net, **SETTINGS), **MUON_KW)
        for s in range(steps):
            net(tokens(s)).backward()
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def sharding(muon) -> str:
    """How the stack holds the Muon's tensors: DeepSpeed's partition kind, "dtensor" (FSDP2) or "plain"."""
    kind = getattr(muon.adapter, "kind", None)
    if kind is not None:
        return kind
    params = [p for g in muon.param_groups for p in g["params"]]
    return "dtensor" if all(type(p).__name__ == "DTensor" for p in params) else "plain"


def fsdp2_layers(module, mesh) -> None:
    """FSDP2 the way torchtitan and Lightning's docs shard: each block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in module.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)


# -- Fabric -----------------------------------------------------------------------------------------
def _fabric_strategy(kind: str):
    if kind == "ddp":
        return "ddp"
    if kind == "fsdp2":
        from lightning.fabric.strategies import ModelParallelStrategy

        return ModelParallelStrategy(parallelize_fn=lambda m, mesh: (fsdp2_layers(m, mesh["data_parallel"]), m)[1],
                                     data_parallel_size=2, tensor_parallel_size=1)
    import ds_muon.lightning

    return ds_muon.lightning.FabricDeepSpeedStrategy(stage=2)


def _fabric_run(kind: str, seed: int, ckpt: str, resume: bool) -> dict:
    import lightning as L

    import ds_muon

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=_fabric_strategy(kind))
    fabric.launch()
    net = make_net(seed)
    if kind == "fsdp2":  # FSDP2 shards first: the Muon is built on the DTensor parameters
        model = fabric.setup_module(net)
        optimizer = fabric.setup_optimizers(ds_muon.Muon(ds_muon.muon_param_groups(model, **SETTINGS), **MUON_KW))
    else:
        model, optimizer = fabric.setup(net, ds_muon.Muon(ds_muon.muon_param_groups(net, **SETTINGS), **MUON_KW))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume:
        fabric.load(ckpt, state)
    while state["step"] < 2 * K:
        fabric.backward(model(tokens(state["step"])))
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        if not resume and state["step"] == K:
            fabric.save(ckpt, state)
    muon = ds_muon.find_muon(optimizer)
    return dict(weights=full_weights(model), adapter=type(muon.adapter).__name__ if muon.adapter else None,
                sharding=sharding(muon))


# -- Trainer ----------------------------------------------------------------------------------------
def _module_class():
    import lightning as L

    import ds_muon

    class Module(L.LightningModule):
        def __init__(self, seed: int, fsdp2: bool = False, dsmuon_entry: bool = False):
            super().__init__()
            self.net, self.fsdp2, self.dsmuon_entry = make_net(seed), fsdp2, dsmuon_entry

        def configure_model(self):
            if self.fsdp2:
                fsdp2_layers(self.net, self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            return self.net(tokens(self.global_step))

        def configure_optimizers(self):
            if self.dsmuon_entry:
                return None
            return ds_muon.Muon(ds_muon.muon_param_groups(self, **SETTINGS), **MUON_KW)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.zeros(64, 1), batch_size=1)

    return Module


def _trainer_strategy(kind: str):
    import ds_muon.lightning

    if kind == "ddp":
        return "ddp"
    if kind == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    if kind == "zero2":
        return ds_muon.lightning.DeepSpeedStrategy(stage=2)
    if kind == "zero3":
        return ds_muon.lightning.DeepSpeedStrategy(stage=3)
    if kind == "zero3_entry":
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
               "optimizer": {"type": "DsMuon", "params": dict(SETTINGS, ns_dtype="float32", log_summary=False)}}
        return ds_muon.lightning.DeepSpeedStrategy(config=cfg)
    raise ValueError(kind)


def _trainer(kind: str, steps: int):
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=2, strategy=_trainer_strategy(kind), max_steps=steps,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False, num_sanity_val_steps=0)


def _trainer_run(kind: str, seed: int, ckpt: str, resume: bool) -> dict:
    import ds_muon

    module = _module_class()(seed, fsdp2=kind == "fsdp2", dsmuon_entry=kind == "zero3_entry")
    if resume:
        trainer = _trainer(kind, 2 * K)
        trainer.fit(module, ckpt_path=ckpt)
    else:
        trainer = _trainer(kind, K)  # K steps (held to K steps in one process), then the checkpoint
        trainer.fit(module)
        trainer.save_checkpoint(ckpt)
    model = trainer.strategy.model
    muon = ds_muon.find_muon(trainer.optimizers[0] if trainer.optimizers else model)
    assert trainer.global_step == (2 * K if resume else K), trainer.global_step
    return dict(weights=full_weights(model), adapter=type(muon.adapter).__name__ if muon.adapter else None,
                sharding=sharding(muon))


def _unbound_refusal() -> str:
    """Lightning's own DeepSpeedStrategy with a Muon from configure_optimizers: nothing binds it."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from ds_muon.lightning import _cpu_device_indices

    class OnCpu(DeepSpeedStrategy):
        """Lightning's strategy as it runs on GPUs: only the CUDA checks lifted, the engine built unchanged."""

        def setup_environment(self):
            super(DeepSpeedStrategy, self).setup_environment()

        def setup_distributed(self):
            with _cpu_device_indices(self):
                super().setup_distributed()

        def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
            import deepspeed

            engine, ds_optimizer, _, _ = deepspeed.initialize(
                config=self.config, model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                optimizer=optimizer, lr_scheduler=lr_scheduler, dist_init_required=False)
            return engine, ds_optimizer

    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=OnCpu(stage=2), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    try:
        trainer.fit(_module_class()(0))
    except RuntimeError as e:
        return str(e)
    return "stepped"


def _worker(rank, world, fabric_kinds, trainer_kinds, tmp):
    out = {}
    for kind in fabric_kinds:
        ckpt = os.path.join(tmp, f"fabric_{kind}")
        out[f"fabric_{kind}"] = (_fabric_run(kind, 0, ckpt, False), _fabric_run(kind, 1, ckpt, True))
    for kind in trainer_kinds:
        ckpt = os.path.join(tmp, f"trainer_{kind}.ckpt")
        out[f"trainer_{kind}"] = (_trainer_run(kind, 0, ckpt, False), _trainer_run(kind, 1, ckpt, True))
    if trainer_kinds:
        out["unbound"] = _unbound_refusal()
    return out


FABRIC = tuple(k for k in os.environ.get("DS_MUON_LIGHTNING_FABRIC", "ddp,fsdp2,zero2").split(",") if k)
TRAINER = tuple(k for k in os.environ.get("DS_MUON_LIGHTNING_TRAINER", "ddp,fsdp2,zero2,zero3_entry").split(",") if k)
ADAPTERS = {"ddp": ("DefaultAdapter", "plain"), "fsdp2": ("DefaultAdapter", "dtensor"),
            "zero2": ("DeepSpeedAdapter", "zero12"), "zero3": ("DeepSpeedAdapter", "zero3"),
            "zero3_entry": ("DeepSpeedAdapter", "zero3")}


@pytest.mark.timeout(600)  # 23 s with 2 cores to itself, 200 s measured on a shared box: 15 Lightning start-ups
def test_lightning_strategies_bitwise_one_process(tmp_path):
    pytest.importorskip("deepspeed")
    ref, ref_k = reference(), reference(K)
    results = dist_harness.run(_worker, 2, FABRIC, TRAINER, str(tmp_path), timeout=600, env=ENV)
    for door in [f"fabric_{k}" for k in FABRIC] + [f"trainer_{k}" for k in TRAINER]:
        kind = door.split("_", 1)[1]
        for rank, r in enumerate(results):
            first, resumed = r[door]
            # Trainer: the run that wrote the checkpoint stopped there (K steps); Fabric's went on to 2K
            first_ref = ref_k if door.startswith("trainer") else ref
            for label, run, want_weights in (("first", first, first_ref), ("resumed", resumed, ref)):
                assert (run["adapter"], run["sharding"]) == ADAPTERS[kind], (door, label, run["adapter"], run["sharding"])
                assert set(run["weights"]) == set(ref), (door, sorted(run["weights"]))
                for n, want in want_weights.items():
                    assert torch.equal(run["weights"][n], want), (door, label, rank, n)
    if TRAINER:
        for r in results:  # every rank refuses, naming the fix
            assert "ds_muon.lightning.DeepSpeedStrategy" in r["unbound"], r["unbound"]


def test_example_lightning_train_deepspeed():
    """examples/lightning_train.py under torchrun at W=2 with ds_muon's DeepSpeed strategy: it learns, ZeRO-2
    holds the Muon's tensors, and Newton-Schulz ran on both ranks."""
    pytest.importorskip("deepspeed")
    from test_examples import _run, _torchrun

    s = _run(_torchrun("lightning_train.py", "--strategy", "deepspeed", "--steps", "20"))
    assert (s["strategy"], s["world"], s["steps"], s["sharding"]) == ("deepspeed", 2, 20, "zero12"), s
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 1.0, s
    assert s["muon_home_ranks"] == [0, 1]

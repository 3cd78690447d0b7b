"""The door matrix: every front door x stage x form x variant, each against ds_muon in one process.

A cell is ``Cell(door, stage, form, variant)``:

* door: ``lightning`` (Trainer), ``fabric``, ``hf_trainer`` (``ds_muon.trainer.MuonTrainer``);
* stage: ``ddp``, ``fsdp2``, ``zero0``..``zero3`` (ZeRO-3 with the decoder layers as DeepSpeed leaf modules)
  and ``zero3_hooks`` (ZeRO-3 as DeepSpeed hooks it by default);
* form: ``optimizer`` (the Muon handed to the door: ``configure_optimizers``, ``fabric.setup``), ``entry``
  (a ``"type": "DsMuon"`` DeepSpeed config entry), ``helper`` (``MuonTrainer(muon_settings=...)``);
* variant: ``plain``, ``accumulation`` (2 micro-batches a step), ``clipping`` (a norm bound that binds
  every step), ``resume`` (checkpoint after half the steps, a fresh model of another seed resumed from it),
  ``evaluation`` (an evaluation every 2 steps, which must change nothing), ``accumulation+resume`` (both: the
  resumed run's loop must restart on an accumulation boundary).

Every rank sees the same batches, so the averaged gradient is the one-process gradient and a cell is
bitwise unless the stack rounds differently; :data:`EXPECT` says which cells are compared within a
tolerance, and why (docs/LIGHTNING.md and docs/TRAINER.md carry the same table).  The model is a tiny
transformers Llama (2 layers, hidden 32, GQA 4/2).  Cells run grouped by door in one spawned pair of
ranks; a failing cell is recorded, not raised, so one run reports the whole matrix.
"""

from __future__ import annotations

import os
import random
import traceback
from typing import Dict, List, NamedTuple, Optional

import torch

import dist_harness
from hf_models import hf_batches, tiny_llama

ENV = {"DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
       "PL_DISABLE_FORK": "1"}
STEPS = 4  # optimizer steps; resume cells checkpoint after STEPS // 2
MICRO = 2  # micro-batches per step in accumulation cells
CLIP = 0.05  # binds on every step of this model (asserted on the reference)
ROWS = 4  # rows per micro-batch
SETTINGS = dict(lr=0.02, adam_lr=3e-3)
MUON_KW = dict(ns_dtype=torch.float32, log_summary=False)
ENTRY_PARAMS = dict(SETTINGS, ns_dtype="float32", log_summary=False)

DOORS = ("lightning", "fabric", "hf_trainer", "accelerate")
STAGES = ("ddp", "fsdp2", "zero0", "zero1", "zero2", "zero3", "zero3_hooks")
VARIANTS = ("plain", "accumulation", "clipping", "resume", "evaluation", "accumulation+resume")


def has(cell: "Cell", part: str) -> bool:
    """Whether the cell's variant includes ``part`` (a variant may combine parts: ``accumulation+resume``)."""
    return part in cell.variant.split("+")


class Cell(NamedTuple):
    door: str
    stage: str
    form: str
    variant: str

    @property
    def name(self) -> str:
        return "-".join(self)


def stages(door: str) -> tuple:
    """The stages a door documents (accelerate: the shipped launch configs, ZeRO-1 through zero1.json)."""
    return tuple(s for s in STAGES if s != "zero0") if door == "accelerate" else STAGES


def forms(door: str, stage: str) -> tuple:
    """The forms the door's docs show at this stage."""
    if door == "hf_trainer":
        return ("helper",)
    if door == "accelerate":  # prepare(accelerator, model, **settings) or prepare(..., optimizer=Muon(...))
        return ("helper", "optimizer")
    if door == "lightning" and stage.startswith("zero"):
        return ("optimizer", "entry")
    return ("optimizer",)


def variants(door: str, stage: str) -> tuple:
    """The variants a door has at a stage (Fabric has no evaluation loop of its own; under DeepSpeed
    Fabric leaves accumulation to the engine's config, which its docs do not show)."""
    if door == "fabric":
        return ("plain", "clipping", "resume") + (("accumulation", "accumulation+resume")
                                                  if not stage.startswith("zero") else ())
    return VARIANTS


def all_cells() -> List[Cell]:
    return [Cell(d, s, f, v) for d in DOORS for s in stages(d) for f in forms(d, s) for v in variants(d, s)]


# Cells not compared bitwise: (door or "*", stage, variant or "*") -> (relative tolerance, why).
_HOOKS = ("DeepSpeed's ZeRO-3 hooks each Linear: autograd then sums the gradient of q/k/v's shared input in "
          "another order (last bits); with the decoder layers as ZeRO-3 leaf modules it is bitwise")
_FSDP2_NORM = ("FSDP2's clip_grad_norm_ sums the shards' squared norms, another order than one tensor's: the "
               "clip factor differs in the last bits")
_DS_NORM = ("DeepSpeed computes the gradient norm itself (per partition or parameter, then summed): the clip "
            "factor differs in the last bits")
EXPECT = {("*", "zero3_hooks", "*"): (1e-5, _HOOKS), ("*", "fsdp2", "clipping"): (1e-5, _FSDP2_NORM)}
EXPECT.update({("*", f"zero{k}", "clipping"): (1e-5, _DS_NORM) for k in range(4)})


def expectation(cell: Cell):
    """``(tolerance or None for bitwise, why)``."""
    for (door, stage, variant), value in EXPECT.items():
        if door in ("*", cell.door) and stage == cell.stage and variant in ("*", cell.variant):
            return value
    return None, "bitwise"


def sample(n: int, seed: int, must=()) -> List[Cell]:
    """``n`` cells drawn with ``seed``, always with the ``must`` cells."""
    cells = all_cells()
    rest = [c for c in cells if c not in must]
    random.Random(seed).shuffle(rest)
    return list(must) + rest[:max(0, n - len(must))]


# -- data and the one-process reference --------------------------------------------------------------
BATCHES = hf_batches(STEPS * MICRO + 2, batch=ROWS)
EVAL = hf_batches(2, batch=ROWS, seed=7)


def micro_batch(step: int, micro: int, m: int) -> torch.Tensor:
    return BATCHES[step * m + micro]


def loss_of(model, idx, num_items=None):
    if num_items is None:
        return model(input_ids=idx, labels=idx).loss
    return model(input_ids=idx, labels=idx, num_items_in_batch=num_items).loss


def _decoder_class():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def leaf_by_config(cell: "Cell") -> bool:
    """``zero3`` cells with a DeepSpeed config of their own name the leaf modules there (the entry, Fabric's
    strategy config, the Trainer's JSON); Lightning's ``DeepSpeedStrategy(stage=3)`` has none, so those cells
    call ``deepspeed.utils.set_z3_leaf_modules`` on the model."""
    return cell.stage == "zero3" and (cell.form == "entry" or cell.door in ("hf_trainer", "fabric", "accelerate"))


def make_model(seed: int, cell: "Cell"):
    """The tiny Llama; at ``zero3`` its decoder layers are DeepSpeed ZeRO-3 leaf modules."""
    model = tiny_llama(seed)
    if cell.stage == "zero3" and not leaf_by_config(cell):
        import deepspeed

        deepspeed.utils.set_z3_leaf_modules(model, [_decoder_class()])
    return model


def reference(variant: str, hf_loss: bool = False) -> Dict[str, torch.Tensor]:
    """ds_muon.Muon in one process on one thread: the weights after STEPS steps of ``variant``.
    ``hf_loss``: the Trainer's loss (token sum over the step's micro-batches / their label count)."""
    import ds_muon

    m = MICRO if variant == "accumulation" else 1
    with dist_harness.one_thread():
        model = tiny_llama(0)
        opt = ds_muon.Muon(ds_muon.muon_param_groups(model, **SETTINGS), **MUON_KW)
        for s in range(STEPS):
            for j in range(m):
                idx = micro_batch(s, j, m)
                if hf_loss:
                    loss = loss_of(model, idx, torch.tensor(m * idx[:, 1:].numel()))
                else:
                    loss = loss_of(model, idx) / m
                loss.backward()
            if variant == "clipping":
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                assert norm > CLIP, f"the clipping cell's bound must bind (norm {norm})"
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def full_weights(model) -> Dict[str, torch.Tensor]:
    """Every weight whole in fp32 by the plain model's names (DeepSpeed's fp32 masters, FSDP2's full DTensors)."""
    out = {}
    deepspeed = any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in model.parameters())
    for n, p in model.named_parameters():
        if deepspeed:
            from deepspeed.utils import safe_get_full_fp32_param

            t = safe_get_full_fp32_param(p)
        elif hasattr(p, "full_tensor"):
            t = p.full_tensor()
        else:
            t = p
        for prefix in ("_forward_module.", "module.", "net."):
            n = n.removeprefix(prefix)
        out[n] = t.detach().float().clone()
    return out


def fsdp2_layers(model, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def deepspeed_config(stage: str, entry: bool, micro_batch: int = 1, clip=None) -> dict:
    """The doors' DeepSpeed config (accumulation comes from the door: Lightning's accumulate_grad_batches,
    the Trainer's "auto"); at ``zero3`` with the decoder layers as leaf modules."""
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_clipping": clip if clip is not None else 0.0,
           "zero_optimization": {"stage": int(stage[4])}}
    if stage == "zero3":
        cfg["zero_optimization"]["leaf_module"] = {"classes": [_decoder_class().__name__]}
    if entry:
        cfg["optimizer"] = {"type": "DsMuon", "params": dict(ENTRY_PARAMS)}
    return cfg


# -- Lightning Trainer ----------------------------------------------------------------------------
class ResumableLoader(torch.utils.data.DataLoader):
    """The micro-batch numbers, resumable the way Lightning resumes a loader mid-epoch (its ``_Stateful``
    protocol: ``state_dict``/``load_state_dict``, saved in the checkpoint): the state is how many batches the
    loop consumed (``consumed``, counted by the module; the fetcher's prefetch runs ahead of it), and a loaded
    one skips them.  Handed a plain loader of only the unseen batches instead, Lightning counts the restored
    batch index against that loader's length and ends the epoch early (docs/LIGHTNING.md, "Resume")."""

    def __init__(self, total: int):
        super().__init__(torch.arange(total).view(-1, 1), batch_size=1)
        self.consumed, self._skip = 0, 0

    def __iter__(self):
        it, skip = super().__iter__(), self._skip
        self._skip = 0
        for k, batch in enumerate(it):
            if k >= skip:
                yield batch

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self._skip = self.consumed = state["consumed"]


# DS_MUON_DOORS_UNSEEN_LOADER=1: a resumed Trainer gets a plain loader of only the batches it has not seen
# instead (what issue 51 did: Lightning cannot resume it exactly; docs/LIGHTNING.md, "Resume mid-epoch")
UNSEEN_LOADER = os.environ.get("DS_MUON_DOORS_UNSEEN_LOADER") == "1"


def _lightning_module(cell: Cell, seed: int, unseen_from: Optional[int] = None):
    """The Trainer's module; its loader hands the micro-batch numbers (:class:`ResumableLoader`; from
    ``unseen_from`` on in a plain loader under :data:`UNSEEN_LOADER`)."""
    import lightning as L

    import ds_muon

    m = MICRO if has(cell, "accumulation") else 1

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model(seed, cell)
            self.val_losses = []

        def configure_model(self):
            if cell.stage == "fsdp2":
                fsdp2_layers(self.net, self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            self.loader.consumed += 1
            if UNSEEN_LOADER:
                print(f"door matrix: seed {seed} step {self.global_step} batch {int(batch.reshape(-1)[0])}", flush=True)
            return loss_of(self.net, BATCHES[int(batch.reshape(-1)[0])])

        def validation_step(self, batch, batch_idx):
            loss = loss_of(self.net, batch[0])
            self.val_losses.append(loss.detach().clone())
            self.log("val_loss", loss, sync_dist=True)

        def configure_optimizers(self):
            if cell.form == "entry":
                return None
            return ds_muon.Muon(ds_muon.muon_param_groups(self, **SETTINGS), **MUON_KW)

        def train_dataloader(self):
            self.loader = ResumableLoader(STEPS * m)
            if UNSEEN_LOADER:  # plain loaders, the resumed one from the first batch it has not seen
                return torch.utils.data.DataLoader(torch.arange(unseen_from or 0, STEPS * m).view(-1, 1), batch_size=1)
            return self.loader

        def val_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.stack(EVAL)), batch_size=None)

    return Module()


def _lightning_strategy(cell: Cell):
    import ds_muon.lightning

    if cell.stage == "ddp":
        return "ddp"
    if cell.stage == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    if cell.form == "entry":
        clip = CLIP if cell.variant == "clipping" else None
        return ds_muon.lightning.DeepSpeedStrategy(config=deepspeed_config(cell.stage, True, clip=clip))
    return ds_muon.lightning.DeepSpeedStrategy(stage=int(cell.stage[4]))


def _lightning_fit(cell: Cell, seed: int, steps: int, ckpt: Optional[str], save: Optional[str]):
    import lightning as L

    kw = {}
    if has(cell, "accumulation"):
        kw["accumulate_grad_batches"] = MICRO
    if cell.variant == "clipping" and cell.form != "entry":
        kw["gradient_clip_val"] = CLIP
    if cell.variant == "evaluation":
        kw.update(val_check_interval=2, check_val_every_n_epoch=None)
    else:
        kw.update(limit_val_batches=0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=_lightning_strategy(cell), max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0, **kw)
    module = _lightning_module(cell, seed, unseen_from=(STEPS // 2) * kw.get("accumulate_grad_batches", 1) if ckpt
                               else None)
    trainer.fit(module, ckpt_path=ckpt)
    if save:
        trainer.save_checkpoint(save)
    assert trainer.global_step == steps, (trainer.global_step, steps)
    return trainer, module


def run_lightning(cell: Cell, tmp: str) -> dict:
    if has(cell, "resume"):
        ckpt = os.path.join(tmp, cell.name + ".ckpt")
        _lightning_fit(cell, 0, STEPS // 2, None, ckpt)
        trainer, module = _lightning_fit(cell, 1, STEPS, ckpt, None)
    else:
        trainer, module = _lightning_fit(cell, 0, STEPS, None, None)
    return dict(weights=full_weights(trainer.strategy.model), evals=[float(v) for v in module.val_losses])


# -- Fabric -------------------------------------------------------------------------------------
def _fabric_strategy(cell: Cell):
    import ds_muon.lightning

    if cell.stage == "ddp":
        return "ddp"
    if cell.stage == "fsdp2":
        from lightning.fabric.strategies import ModelParallelStrategy

        return ModelParallelStrategy(parallelize_fn=lambda m, mesh: (fsdp2_layers(m, mesh["data_parallel"]), m)[1],
                                     data_parallel_size=2, tensor_parallel_size=1)
    clip = CLIP if cell.variant == "clipping" else None  # under DeepSpeed the engine clips (its config)
    return ds_muon.lightning.FabricDeepSpeedStrategy(config=deepspeed_config(cell.stage, False, clip=clip))


def _fabric_run(cell: Cell, seed: int, ckpt: str, part: str) -> dict:
    import lightning as L

    import ds_muon

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=_fabric_strategy(cell))
    fabric.launch()
    net = make_model(seed, cell)
    if cell.stage == "fsdp2":  # FSDP2 shards first: the Muon is built on the DTensor parameters
        model = fabric.setup_module(net)
        optimizer = fabric.setup_optimizers(ds_muon.Muon(ds_muon.muon_param_groups(model, **SETTINGS), **MUON_KW))
    else:
        model, optimizer = fabric.setup(net, ds_muon.Muon(ds_muon.muon_param_groups(net, **SETTINGS), **MUON_KW))
    m = MICRO if has(cell, "accumulation") else 1
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if part == "second":
        fabric.load(ckpt, state)
    end = STEPS // 2 if part == "first" else STEPS
    while state["step"] < end:
        for j in range(m):
            with fabric.no_backward_sync(model, enabled=j < m - 1):
                fabric.backward(loss_of(model, micro_batch(state["step"], j, m)) / m)
        if cell.variant == "clipping" and not cell.stage.startswith("zero"):
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
    if part == "first":
        fabric.save(ckpt, state)
    return dict(weights=full_weights(model), evals=[])


def run_fabric(cell: Cell, tmp: str) -> dict:
    if has(cell, "resume"):
        ckpt = os.path.join(tmp, cell.name)
        _fabric_run(cell, 0, ckpt, "first")
        return _fabric_run(cell, 1, ckpt, "second")
    return _fabric_run(cell, 0, "", "all")


# -- Hugging Face Trainer -------------------------------------------------------------------------
class TokenRows(torch.utils.data.Dataset):
    """Token rows as a causal LM's dataset: each row its own labels (the Trainer shifts them)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _same_batches_on_every_rank(batches, world: int) -> TokenRows:
    """Rows in order, each batch once per rank: accelerate deals batch k to rank k % world."""
    return TokenRows([row for b in batches for _ in range(world) for row in b])


def _hf_trainer(cell: Cell, seed: int, out_dir: str, steps: int, save_steps: Optional[int]):
    from transformers import TrainingArguments

    from ds_muon.trainer import MuonTrainer

    class Sequential(MuonTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def _get_eval_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.eval_dataset)

    m = MICRO if has(cell, "accumulation") else 1
    stack = {}
    if cell.stage == "fsdp2":
        stack = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "reshard_after_forward": True})
    elif cell.stage.startswith("zero"):
        cfg = deepspeed_config(cell.stage, True, micro_batch=ROWS)
        cfg.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto", gradient_clipping="auto")
        stack = dict(deepspeed=cfg)
    ev = {}
    if cell.variant == "evaluation":
        ev = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=ROWS)
    save = dict(save_strategy="steps", save_steps=save_steps) if save_steps else dict(save_strategy="no")
    args = TrainingArguments(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=ROWS,
                             gradient_accumulation_steps=m, max_grad_norm=CLIP if cell.variant == "clipping" else 0.0,
                             lr_scheduler_type="constant", logging_steps=1, report_to="none", use_cpu=True, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True, average_tokens_across_devices=False,
                             **save, **ev, **stack)
    world = args.world_size
    train = _same_batches_on_every_rank([micro_batch(s, j, m) for s in range(STEPS) for j in range(m)], world)
    evald = _same_batches_on_every_rank(EVAL, world) if ev else None
    return Sequential(model=make_model(seed, cell), args=args, train_dataset=train, eval_dataset=evald,
                      muon_settings=dict(SETTINGS, **MUON_KW))


def run_hf_trainer(cell: Cell, tmp: str) -> dict:
    from test_front_doors import _fresh_accelerate

    def fresh():  # accelerate's singletons and its ACCELERATE_* environment (TrainingArguments(deepspeed=...)
        _fresh_accelerate({})  # sets ACCELERATE_USE_DEEPSPEED and leaves it: the next cell would be DeepSpeed)

    out_dir = os.path.join(tmp, cell.name)
    fresh()
    if has(cell, "resume"):
        _hf_trainer(cell, 0, out_dir, STEPS, STEPS // 2).train()  # the straight run writes checkpoint-STEPS//2
        fresh()
        trainer = _hf_trainer(cell, 1, out_dir + "_resumed", STEPS, None)
        trainer.train(resume_from_checkpoint=os.path.join(out_dir, f"checkpoint-{STEPS // 2}"))
    else:
        trainer = _hf_trainer(cell, 0, out_dir, STEPS, None)
        trainer.train()
    evals = [r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r]
    return dict(weights=full_weights(trainer.model_wrapped), evals=evals)


# -- accelerate -----------------------------------------------------------------------------------
LAUNCH = {"ddp": "ddp", "fsdp2": "fsdp2", "zero1": "deepspeed_zero1", "zero2": "deepspeed_zero2",
          "zero3": "deepspeed_zero3", "zero3_hooks": "deepspeed_zero3"}


def _accelerate_env(cell: Cell, tmp: str) -> dict:
    """The environment ``accelerate launch --config_file configs/accelerate/<stage>.yaml`` gives a rank; under
    DeepSpeed its JSON with this cell's micro-batch, accumulation, clipping (and ZeRO-3 leaf modules)."""
    import json

    from test_front_doors import _fresh_accelerate, launch_env

    _fresh_accelerate({})  # accelerate's env builders start from os.environ: an earlier cell's ACCELERATE_* leaked
    env = launch_env(LAUNCH[cell.stage])
    path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path:
        with open(path) as f:
            cfg = json.load(f)
        cfg.update(train_micro_batch_size_per_gpu=ROWS, gradient_accumulation_steps=MICRO if has(cell, "accumulation") else 1, gradient_clipping=CLIP if cell.variant == "clipping" else 0.0)
        if cell.stage == "zero3":
            cfg["zero_optimization"]["leaf_module"] = {"classes": [_decoder_class().__name__]}
        if cell.form == "optimizer":  # a Muon of one's own: the config without the DsMuon entry (prepare refuses both)
            del cfg["optimizer"]
        # one file per rank: a rank must not read the file while another rewrites it
        env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = os.path.join(tmp, f"{cell.name}.rank{os.environ['RANK']}.json")
        with open(env["ACCELERATE_DEEPSPEED_CONFIG_FILE"], "w") as f:
            json.dump(cfg, f)
    return env


def _accelerate_run(cell: Cell, seed: int, ckpt: str, part: str) -> dict:
    import ds_muon
    from ds_muon.accelerate import Accelerator, prepare
    from test_front_doors import _fresh_accelerate

    m = MICRO if has(cell, "accumulation") else 1
    _fresh_accelerate(_accelerate_env(cell, os.path.dirname(ckpt)))
    accelerator = Accelerator(gradient_accumulation_steps=m)
    model = make_model(seed, cell)
    if cell.form == "optimizer":
        model, opt = prepare(accelerator, model, optimizer=ds_muon.Muon(ds_muon.muon_param_groups(model, **SETTINGS),
                                                                       **MUON_KW))
    else:
        model, opt = prepare(accelerator, model, **SETTINGS, **MUON_KW)
    if part == "second":
        accelerator.load_state(ckpt)
    evals = []
    for s in range(STEPS // 2 if part == "second" else 0, STEPS // 2 if part == "first" else STEPS):
        for j in range(m):
            with accelerator.accumulate(model):
                accelerator.backward(loss_of(model, micro_batch(s, j, m)))
                if cell.variant == "clipping" and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                opt.zero_grad()
        if cell.variant == "evaluation" and s % 2 == 1:
            with torch.no_grad():
                losses = [accelerator.gather_for_metrics(loss_of(model, b).detach()[None]) for b in EVAL]
            evals.append(float(torch.cat(losses).mean()))
    if part == "first":
        accelerator.save_state(ckpt)
    accelerator.wait_for_everyone()
    return dict(weights=full_weights(model), evals=evals)


def run_accelerate(cell: Cell, tmp: str) -> dict:
    ckpt = os.path.join(tmp, cell.name)
    if has(cell, "resume"):
        _accelerate_run(cell, 0, ckpt, "first")
        return _accelerate_run(cell, 1, ckpt, "second")
    return _accelerate_run(cell, 0, ckpt, "all")


RUNNERS = {"lightning": run_lightning, "fabric": run_fabric, "hf_trainer": run_hf_trainer, "accelerate": run_accelerate}


def _worker(rank, world, cells, tmp):
    """Every cell in turn in this pair of ranks; a failing cell's error is its result."""
    out = {}
    for cell in cells:
        print(f"door_matrix: rank {rank} runs {cell.name}", flush=True)  # a hang names its cell
        try:
            out[cell] = RUNNERS[cell.door](cell, tmp)
        except Exception as e:  # noqa: BLE001 - recorded per cell, reported by the caller
            out[cell] = dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-3000:])
            print(f"door_matrix: rank {rank} {cell.name} failed:\n{out[cell]['trace']}", flush=True)
    return out


def run_cells(cells, tmp: str, timeout: float = 1800) -> Dict[Cell, list]:
    """Every rank's result for each cell (one pair of pooled ranks, the cells of a door per call)."""
    results: Dict[Cell, list] = {}
    for door in DOORS:
        mine = [c for c in cells if c.door == door]
        if mine:
            per_rank = dist_harness.run(_worker, 2, mine, tmp, timeout=timeout, env=ENV)
            for c in mine:
                results[c] = [r[c] for r in per_rank]
    return results


def max_relative(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> float:
    return max(((got[n] - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() for n, w in want.items())


def judge(cell: Cell, per_rank: list, refs: Dict[tuple, dict]) -> tuple:
    """``(held, detail)`` of one cell against the one-process run."""
    tol, why = expectation(cell)
    base = "accumulation" if has(cell, "accumulation") else "plain" if cell.variant in ("resume", "evaluation") \
        else cell.variant
    want = refs[(cell.door == "hf_trainer", base)]
    worst, bitwise = 0.0, True
    for r in per_rank:
        if "error" in r:
            return False, r["error"]
        if set(r["weights"]) != set(want):
            return False, f"names differ: {sorted(set(r['weights']) ^ set(want))}"
        bitwise &= all(torch.equal(r["weights"][n], w) for n, w in want.items())
        worst = max(worst, max_relative(r["weights"], want))
    if cell.variant == "evaluation":
        evals = [r["evals"] for r in per_rank]
        if not evals[0] or any(e != evals[0] for e in evals):
            return False, f"evaluation did not run or differs between ranks: {evals}"
    held = bitwise if tol is None else worst <= tol
    detail = "bitwise" if bitwise else f"max relative {worst:.3g}"
    return held, detail + ("" if tol is None else f" (<= {tol}: {why})")


def references() -> Dict[tuple, dict]:
    return {(hf, v): reference(v, hf_loss=hf) for hf in (False, True) for v in ("plain", "accumulation", "clipping")}


def table(results: Dict[Cell, list], refs) -> List[tuple]:
    return [(cell, *judge(cell, per_rank, refs)) for cell, per_rank in results.items()]


if __name__ == "__main__":  # python tests/door_matrix.py [substring ...]: the matching cells, one line a cell
    import sys
    import tempfile

    chosen = [c for c in all_cells() if not sys.argv[1:] or any(a in c.name for a in sys.argv[1:])]
    refs = references()
    rows = table(run_cells(chosen, tempfile.mkdtemp()), refs)
    for cell, held, detail in rows:
        print(f"{'held' if held else 'FAIL'}  {cell.name}  {detail}", flush=True)
    print(f"{sum(h for _, h, _ in rows)}/{len(rows)} held")


# -- the docs' tables ----------------------------------------------------------------------------------
NOTES = {_HOOKS: "hooks", _FSDP2_NORM: "fsdp2-norm", _DS_NORM: "ds-norm"}


def docs_table(doors) -> str:
    """The Markdown table docs/LIGHTNING.md and docs/TRAINER.md carry (test_door_matrix checks they do):
    per door, stage and form, each variant's comparison with the one-process run."""
    cells = set(all_cells())
    lines = ["| door | stage | form | " + " | ".join(VARIANTS) + " |", "| --- " * (3 + len(VARIANTS)) + "|"]
    for door in doors:
        for stage in STAGES:
            for form in forms(door, stage):
                row = []
                for variant in VARIANTS:
                    cell = Cell(door, stage, form, variant)
                    if cell not in cells:
                        row.append("-")
                        continue
                    tol, why = expectation(cell)
                    row.append("bitwise" if tol is None else f"<= {tol:g} ({NOTES[why]})")
                lines.append(f"| {door} | {stage} | {form} | " + " | ".join(row) + " |")
    return "\n".join(lines)

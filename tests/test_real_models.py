"""ds_muon on Hugging Face ``transformers`` models built from tiny configs (no downloads).

Our own GPT is not enough: these are the models users bring.  Each front door is
checked for *which tensors take Muon* (against a rule written out here, not the
library's), for sharded = single-process parity (``torch.equal``, fp32 and bf16 NS),
and, where ranks hold replicas, for replicas that are still equal at the end.
DeepSpeed ZeRO-2/3 (``zero.Init``) runs are in ``test_real_models_zero.py``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import ds_muon  # noqa: E402

import dist_harness  # noqa: E402
from hf_models import FAMILIES, hf_batches, hf_loss  # noqa: E402

GROUPS = dict(lr=0.02, adam_lr=3e-3, weight_decay=0.1, adam_weight_decay=0.01)
STEPS = 2
DENSE = ("llama", "gpt2")


def expected_muon(family: str, model) -> set:
    """Hidden matrices, written out per family: attention and MLP projections; never embeddings,
    the output head, norms or biases."""
    names = {n for n, p in model.named_parameters() if n.endswith(".weight") and p.ndim == 2}
    if family == "gpt2":
        return {n for n in names if ".attn.c_" in n or ".mlp.c_" in n}
    return {n for n in names if any(k in n for k in ("_proj.", "self_attn."))} - {"lm_head.weight"}


def muon_names(groups) -> set:
    return {n for g in groups if g.get("use_muon", True) for n in g["param_names"]}


@pytest.mark.parametrize("family", DENSE)
def test_which_tensors_take_muon(family):
    model = FAMILIES[family]()
    want = expected_muon(family, model)
    assert want and muon_names(ds_muon.muon_param_groups(model)) == want


def test_llama_matches_torch_optim_muon_bitwise():
    """The single-process maths on a real model against torch's own Muon (bf16 NS, one thread)."""
    with dist_harness.one_thread():
        a, b = FAMILIES["llama"](), FAMILIES["llama"]()
        mats_a = [p for n, p in a.named_parameters() if n in expected_muon("llama", a)]
        mats_b = [p for n, p in b.named_parameters() if n in expected_muon("llama", b)]
        ours = ds_muon.Muon(mats_a, lr=0.02, momentum=0.95, weight_decay=0.1, ns_dtype=torch.bfloat16,
                            ns_method="standard")  # torch's NS, whatever auto picks
        ref = torch.optim.Muon(mats_b, lr=0.02, momentum=0.95, weight_decay=0.1, adjust_lr_fn="original")
        for idx in hf_batches(STEPS):
            for model, opt in ((a, ours), (b, ref)):
                hf_loss(model, idx).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        for pa, pb in zip(mats_a, mats_b):
            assert torch.equal(pa, pb)


# -- FSDP2 at W=2 against one process -----------------------------------------------------------------
def _layers(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def _single(family, ns_dtype):
    with dist_harness.one_thread():
        model = FAMILIES[family]()
        opt = ds_muon.Muon(ds_muon.muon_param_groups(model, **GROUPS), ns_dtype=ns_dtype)
        for idx in hf_batches(STEPS):
            hf_loss(model, idx).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {n: p.detach().clone() for n, p in model.named_parameters()}, muon_names(opt.param_groups)


def _wrap(model, stack, world, ns_dtype):
    """(wrapped model, Muon, full parameters()) under FSDP2 (each decoder layer and the root) or FSDP1
    (one flat parameter per decoder layer, ``use_orig_params=False``: original tensors hidden)."""
    if stack == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in _layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = ds_muon.Muon(ds_muon.muon_param_groups(model, **GROUPS), ns_dtype=ns_dtype)
        return model, opt, lambda: {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    fsdp = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({type(_layers(model)[0])}))
    opt = ds_muon.Muon(ds_muon.muon_param_groups(fsdp, **GROUPS), model=fsdp, ns_dtype=ns_dtype)

    def full():
        with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT):
            return {n: t.detach().clone() for n, t in fsdp.state_dict().items()}
    return fsdp, opt, full


def _fsdp_worker(rank, world, cases):
    out = {}
    for family, ns_dtype, stack in cases:
        model, opt, full = _wrap(FAMILIES[family](), stack, world, ns_dtype)
        for idx in hf_batches(STEPS):  # the same batch on every rank: the average is exact
            hf_loss(model, idx).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        scales = sorted({round(ds_muon.get_muon_scale_factor(*((c, r) if s.transposed else (r, c))), 6)
                         for b in opt.runtime.bindings.values() for s in b.matrices for r, c in [s.matrix_shape]})
        out[family, ns_dtype, stack] = full(), scales
    return out


def test_fsdp_equals_single_process():
    """FSDP2 (fp32 and bf16 NS) and FSDP1 flat parameters, W=2, equal one process; GPT-2's Conv1D
    weights keep their [out, in] scale factors although FSDP1 hides the tagged tensors."""
    cases = [(f, d, "fsdp2") for f in DENSE for d in (torch.float32, torch.bfloat16)]
    cases += [(f, torch.float32, "fsdp1") for f in DENSE]
    results = dist_harness.run(_fsdp_worker, 2, cases, timeout=300)
    for family, ns_dtype, stack in cases:
        want, want_muon = _single(family, ns_dtype)
        assert want_muon == expected_muon(family, FAMILIES[family]())
        for out in results:
            got, scales = out[family, ns_dtype, stack]
            if family == "gpt2":  # c_attn's q, k, v 32 -> 32 each (issue 24: split), c_fc 32 -> 128, c_proj back
                assert scales == [1.0, 2.0], scales
            for n, t in want.items():
                assert torch.equal(got[n], t), (family, ns_dtype, stack, n)


# -- transformers.Trainer, DDP over 2 ranks --------------------------------------------------------------
def _trainer_worker(rank, world, out_dir):
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    class Tokens(Dataset):
        def __init__(self, n):
            self.rows = torch.cat(hf_batches(n, batch=1, seed=3))

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {"input_ids": self.rows[i], "labels": self.rows[i]}

    model = FAMILIES["llama"]()
    groups = ds_muon.muon_param_groups(model, **GROUPS)
    opt = ds_muon.Muon(groups)
    args = TrainingArguments(output_dir=out_dir, max_steps=4, per_device_train_batch_size=2, logging_steps=1,
                             save_strategy="no", report_to="none", use_cpu=True, ddp_backend="gloo",
                             dataloader_num_workers=0, disable_tqdm=True, eval_on_start=True,
                             per_device_eval_batch_size=2)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(16), eval_dataset=Tokens(4),
                      optimizers=(opt, None))
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    return ({n: p.detach().clone() for n, p in model.named_parameters()}, muon_names(groups),
            type(trainer.model_wrapped).__name__, losses)


def test_trainer_ddp_keeps_replicas_equal(tmp_path):
    # OMP_NUM_THREADS set: else accelerate's state sets each rank's threads to cores / ranks (a leak the
    # next call in the pooled rank would see)
    (p0, muon0, wrapped, losses), (p1, muon1, _, _) = dist_harness.run(_trainer_worker, 2, str(tmp_path),
                                                                      timeout=240, env={"OMP_NUM_THREADS": "1"})
    assert wrapped == "DistributedDataParallel" and len(losses) == 4
    assert muon0 == muon1 == expected_muon("llama", FAMILIES["llama"]())
    fresh = dict(FAMILIES["llama"]().named_parameters())
    for n, t in p0.items():
        assert torch.equal(t, p1[n]), n  # replicas stayed replicas
        assert not torch.equal(t, fresh[n]), n  # and every tensor trained

"""Issue 40's rules in the model map, on models written as people write them (tests/map_models.py):

* the final output layer takes AdamW for every model (a conv classifier's ``fc`` after a hidden Linear, an LM
  head whose logits are transposed, ``Embedding → Linear → Linear``, a UNet's ``conv_out`` returned as
  ``.sample`` of a dataclass, a DiT's final projection unpatchified by an einsum): its update is AdamW's
  first step; ``include=`` keeps one on Muon and ``summary()`` says so;
* raw parameters applied through ``einsum`` take Muon on the ``[out, in]`` matrix the equation applies:
  the update is a hand Newton–Schulz of that matrix with the shape scale of that orientation (a wrong
  orientation would scale ``[D, H·hd]`` differently);
* bare, under DDP and under FSDP2 at W=2 the updates are equal (``torch.equal``)."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

import ds_muon

sys.path.insert(0, os.path.dirname(__file__))
import dist_harness  # noqa: E402
import map_models as M  # noqa: E402

GROUPS = dict(lr=0.02, adam_lr=3e-3, weight_decay=0.0, adam_weight_decay=0.01)
OPT = dict(momentum=0.0, nesterov=False, ns_dtype=torch.float32)
NAMES = tuple(M.MODELS)


def _groups(model, name, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ds_muon.muon_param_groups(model, example_inputs=M.example_inputs(name), **GROUPS, **kw)


def _sets(groups):
    muon = {n for g in groups if g["use_muon"] for n in g["param_names"]}
    adam = {n for g in groups if not g["use_muon"] for n in g["param_names"]}
    return muon, adam


def _step(name, model, opt):
    args, target = M.batch(name)
    M.loss(name, model, args, target).backward()
    opt.step()


def _single(name):
    """One step of ``name`` in one process: (model after, groups, weights before, gradients)."""
    with dist_harness.one_thread():
        model = M.build(name)
        groups = _groups(model, name)
        opt = ds_muon.Muon(groups, **OPT)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        args, target = M.batch(name)
        M.loss(name, model, args, target).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        return model, groups, before, grads


# -- the decisions ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_the_output_layer_takes_adamw_decided_by_the_trace(name):
    model = M.build(name)
    muon, adam = _sets(_groups(model, name))
    out = M.OUTPUT_LAYERS[name]
    assert out in adam, (name, sorted(muon))
    decided = dict(ds_muon.models.reading.model_map(model, example_inputs=M.example_inputs(name)))
    assert decided[out].kind == "output head" and decided[out].decided_by == "trace", decided[out]
    matrices = {n for n, p in model.named_parameters() if p.ndim >= 2}
    hidden = {"conv_classifier": {"conv.weight", "hidden.weight"}, "transposed_lm": {"up.weight", "down.weight"},
              "embedding_stack": {"a.weight"}, "unet": {"time_proj.weight", "down.weight", "mid.weight", "up.weight",
                                                        "fuse.weight"},
              "dit": {"ada.weight", "qkv.weight", "attn_out.weight"},
              "einsum_lm": {"wq", "wk", "wv", "wo", "w_in", "w_out"}}[name]
    assert muon == hidden, (name, sorted(muon))  # nothing else moved: stems, embeddings, tables stay AdamW
    assert matrices - hidden <= adam


def test_einsum_weights_read_from_their_equations():
    model = M.build("einsum_lm")
    decided = dict(ds_muon.models.reading.model_map(model, example_inputs=M.example_inputs("einsum_lm")))
    d, h, hd = model.wq.shape
    ff = model.w_in.shape[1]
    assert f"one [{h * hd}, {d}] matrix applied by 'bsd,dhk->bhsk', stored [in, out]" in decided["wq"].reason
    assert f"one [{d}, {h * hd}] matrix applied by 'bhsk,dhk->bsd'" in decided["wo"].reason
    assert f"one [{ff}, {d}] matrix applied by 'bsd,df->bsf', stored [in, out]" in decided["w_in"].reason
    assert decided["wq"].plan.transposed and not decided["wo"].plan.transposed and decided["w_out"].plan.transposed


# -- the updates against hand references --------------------------------------------------------------------
def _adamw_first_step(w0, grad, group):
    p = torch.nn.Parameter(w0.clone())
    p.grad = grad.clone()
    torch.optim.AdamW([p], lr=group["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=group["weight_decay"]).step()
    return p.detach()


def _muon(w0, matrix, back):
    """``w0`` after one Muon step whose NS input is ``matrix`` (the [out, in] map, a view of the gradient);
    ``back`` lays an [out, in] update out as the tensor is stored; also the update with the scale of the
    other orientation (what a wrong reading would give)."""
    o = ds_muon.newton_schulz(matrix, dtype=torch.float32, method="auto")
    lr = GROUPS["lr"]
    right = w0.clone().add_(back(o), alpha=-lr * ds_muon.get_muon_scale_factor(*matrix.shape))
    wrong = w0.clone().add_(back(o), alpha=-lr * ds_muon.get_muon_scale_factor(matrix.shape[1], matrix.shape[0]))
    return right, wrong


def _matrix_refs(name, model, before, grads):
    """``{tensor: ([out, in] matrix of its gradient, back)}`` for the Muon weights of ``name``, by hand."""
    def linear(n):
        return grads[n].reshape(grads[n].shape[0], -1), lambda o, s=grads[n].shape: o.reshape(s)

    if name == "einsum_lm":
        d, h, hd = model.wq.shape
        refs = {w: (grads[w].reshape(d, h * hd).T, lambda o: o.T.reshape(d, h, hd)) for w in ("wq", "wk", "wv")}
        refs["wo"] = (grads["wo"].reshape(d, h * hd), lambda o: o.reshape(d, h, hd))  # "bhsk,dhk->bsd": [D, H·hd]
        refs["w_in"] = (grads["w_in"].T, lambda o: o.T)  # [D, F] stored [in, out]
        refs["w_out"] = (grads["w_out"].T, lambda o: o.T)
        return refs
    plain = {"conv_classifier": ("conv.weight", "hidden.weight"), "transposed_lm": ("up.weight", "down.weight"),
             "embedding_stack": ("a.weight",), "unet": ("mid.weight", "down.weight", "fuse.weight"),
             "dit": ("attn_out.weight",)}[name]  # ada and qkv: chunked, blocks (issue 32)
    return {n: linear(n) for n in plain}


@pytest.mark.parametrize("name", NAMES)
def test_updates_equal_hand_references(name):
    model, groups, before, grads = _single(name)
    params = dict(model.named_parameters())
    adam_group = next(g for g in groups if not g["use_muon"])
    out = M.OUTPUT_LAYERS[name]
    want = _adamw_first_step(before[out], grads[out], adam_group)
    assert torch.allclose(params[out].detach(), want, rtol=0, atol=1e-7), name  # AdamW's first step
    as_matrix = grads[out].reshape(grads[out].shape[0], -1)
    muon_step = before[out] - GROUPS["lr"] * ds_muon.get_muon_scale_factor(*as_matrix.shape) * ds_muon.newton_schulz(
        as_matrix, dtype=torch.float32, method="auto").reshape(grads[out].shape)
    assert not torch.allclose(params[out].detach(), muon_step, atol=1e-5)  # Muon would be another update
    for n, (matrix, back) in _matrix_refs(name, model, before, grads).items():
        right, wrong = _muon(before[n], matrix, back)
        assert torch.equal(params[n].detach(), right), (name, n)
        if ds_muon.get_muon_scale_factor(*matrix.shape) != ds_muon.get_muon_scale_factor(*reversed(matrix.shape)):
            assert not torch.allclose(params[n].detach(), wrong, atol=1e-6), (name, n)  # the orientation counts


def test_include_keeps_the_output_layer_on_muon_and_summary_says_so():
    model = M.build("conv_classifier")
    groups = _groups(model, "conv_classifier", include=["fc.weight"])
    muon, _ = _sets(groups)
    assert "fc.weight" in muon
    opt = ds_muon.Muon(groups, **OPT)
    row = next(t for t in opt.summary().tensors if t.name == "fc.weight")
    assert row.algorithm == "Muon" and "include='fc.weight'" in row.reason and "output head" in row.reason, row.reason


# -- bare, DDP and FSDP2 alike ------------------------------------------------------------------------------
def _worker(rank, world, cases):
    out = {}
    for name, stack in cases:
        model = M.build(name)
        if stack == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            wrapped = DDP(model)
            opt = ds_muon.Muon(_groups(wrapped, name), **OPT)
            _step(name, wrapped, opt)
            full = {n: p.detach().clone() for n, p in model.named_parameters()}
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
            opt = ds_muon.Muon(_groups(model, name), **OPT)
            _step(name, model, opt)
            full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        muon = {n for g in opt.param_groups if g["use_muon"] for n in g["param_names"]}
        out[name, stack] = (full, {n.replace("module.", "", 1) for n in muon})
    return out


def _has_litgpt() -> bool:
    try:
        import litgpt  # noqa: F401
    except ImportError:
        return False
    return True


SHARDED = ("conv_classifier", "transposed_lm", "unet", "dit", "einsum_lm") + (("litgpt",) if _has_litgpt() else ())


def test_ddp_and_fsdp2_equal_one_process():
    cases = [(n, s) for n in SHARDED for s in ("ddp", "fsdp2")]
    results = dist_harness.run(_worker, 2, cases, timeout=600)
    for name, stack in cases:
        model, groups, _, _ = _single(name)
        muon, _ = _sets(groups)
        for out in results:
            full, got_muon = out[name, stack]
            assert got_muon == muon, (name, stack, sorted(got_muon ^ muon))
            for n, p in model.named_parameters():
                assert torch.equal(full[n], p.detach()), (name, stack, n)


# -- litgpt's GPT, its inputs found without example_inputs ----------------------------------------------------
def test_litgpt_gpt_without_example_inputs():
    """No example_inputs: the inputs are found (token ids for ``forward(idx)``), so the trace reads ``attn.qkv``
    as its three GQA blocks; the step is a hand NS per block (sizes from litgpt's config), lm_head AdamW's."""
    pytest.importorskip("litgpt")
    model = M.build("litgpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decided = dict(ds_muon.models.reading.model_map(model))
    assert decided["lm_head.weight"].kind == "output head" and decided["lm_head.weight"].decided_by == "trace"
    assert not decided["transformer.wte.weight"].muon
    qkv = decided["transformer.h.0.attn.qkv.weight"]
    assert qkv.muon and qkv.decided_by == "trace" and qkv.plan is not None, qkv
    model, groups, before, grads = _single("litgpt")
    c = model.config
    q, kv = c.n_head * c.head_size, c.n_query_groups * c.head_size
    name = "transformer.h.0.attn.qkv.weight"
    w, g, w0 = dict(model.named_parameters())[name].detach(), grads[name], before[name]
    for rows in (range(0, q), range(q, q + kv), range(q + kv, q + 2 * kv)):
        idx = torch.tensor(list(rows))
        right, _ = _muon(w0[idx], g[idx], lambda o: o)
        assert torch.equal(w[idx], right), rows
    adam_group = next(gr for gr in groups if not gr["use_muon"])
    want = _adamw_first_step(before["lm_head.weight"], grads["lm_head.weight"], adam_group)
    assert torch.allclose(dict(model.named_parameters())["lm_head.weight"].detach(), want, rtol=0, atol=1e-7)


def test_readme_precedence_is_the_decision_functions_own():
    """The README's order of precedence is generated from ``PRECEDENCE`` (tools/rules_table.py) and its kinds
    table lists exactly the closed list of kinds, each given by some rule: the two cannot drift."""
    import re
    import sys

    root = os.path.join(os.path.dirname(__file__), os.pardir)
    sys.path.insert(0, os.path.join(root, "tools"))
    import rules_table

    from ds_muon.models.decide import PRECEDENCE
    from ds_muon.models.kinds import KINDS

    readme = open(os.path.join(root, "README.md")).read()
    assert rules_table.readme_section(readme) == rules_table.table(), "run: python tools/rules_table.py --write"
    listed = set(re.findall(r"^\| ([a-z/1\-D ]+?)[:(|]", readme.split("| kind | optimizer | why |")[1].split("\n\n")[0],
                            re.M))
    assert {k.strip() for k in listed} - {"---"} == set(KINDS)
    assert set(KINDS) == {k for entry in PRECEDENCE for k in entry.kinds}

"""Split blocks (fused QKV), tensor-parallel shards and MoE domains, bitwise against one process.

* Split blocks: a fused ``[q | k | v]`` GQA weight tagged with ``ds_muon.split_rows``
  steps exactly like separate q, k, v parameters (each block its own NS task and
  scale), in one process, replicated at W=2, and flat-sharded at W=2 with cuts
  inside blocks.
* Tensor parallelism (W=4): column- and row-parallel shards at TP=4 and at
  TP=2 × DP=2 equal the full weights stepped in one process; the logical shape
  (and so the scale) is the global one; still one fused exchange each way.
* MoE (W=4, dense group of 4, expert parallel 2 × expert data parallel 2): expert
  stacks ``[E, out, in]`` are E matrices, expert shards live in their expert
  data-parallel domain with their own exchange, agreement is checked per domain,
  and a DeepSpeed MoE model trains with ZeRO-2.
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ds_muon
from ds_muon.integrations.local import bind_replicated
from ds_muon.engine.exchange.layout import ParamBinding
from ds_muon.engine.exchange.slots import block_slots
from ds_muon.tensors.tag_keys import EXPERTS

import dist_harness
from models import HandAdapter

D = 8
QKV = {"q": 16, "k": 8, "v": 8}  # GQA: 2 query heads per kv head, head_dim 8 — scales differ per block
STEPS = 3
OPTS = dict(lr=0.05, momentum=0.9, weight_decay=0.1, ns_dtype=torch.float32)


def _one_thread(fn):
    def wrapped(*a, **k):
        with dist_harness.one_thread():
            return fn(*a, **k)
    return wrapped


# -- split blocks ------------------------------------------------------------------
class FusedAttn(nn.Module):
    """A fused GQA projection that declares its head layout, and an output projection."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D, bias=False)  # the input layer (AdamW): qkv reads hidden states
        self.qkv = nn.Linear(D, sum(QKV.values()), bias=False)
        self.qkv.ds_muon_row_blocks = {"weight": dict(QKV)}
        self.out = nn.Linear(16, D, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(self.inp(x)).split(list(QKV.values()), dim=-1)
        return self.out(q * torch.cat([k * v, k - v], dim=-1))


class SeparateAttn(nn.Module):
    def __init__(self, fused: FusedAttn):
        super().__init__()
        self.inp = nn.Linear(D, D, bias=False)
        self.inp.weight.data.copy_(fused.inp.weight)
        self.q, self.k, self.v = (nn.Linear(D, n, bias=False) for n in QKV.values())
        with torch.no_grad():
            for lin, w in zip((self.q, self.k, self.v), fused.qkv.weight.split(list(QKV.values()))):
                lin.weight.copy_(w)
        self.out = nn.Linear(16, D, bias=False)
        self.out.weight.data.copy_(fused.out.weight)

    def forward(self, x):  # the fused model's forward, so both are read alike (out: the output layer)
        x = self.inp(x)
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.out(q * torch.cat([k * v, k - v], dim=-1))


def _qkv_grads(step):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(sum(QKV.values()), D, generator=g), torch.randn(D, 16, generator=g)


def _w0():
    return torch.randn(sum(QKV.values()), D, generator=torch.Generator().manual_seed(3)) * 0.2


@_one_thread
def _separate_reference():
    w = _w0()
    q, k, v = (nn.Parameter(x.clone()) for x in w.split(list(QKV.values())))
    opt = ds_muon.Muon([q, k, v], **OPTS)
    for t in range(STEPS):
        g, _ = _qkv_grads(t)
        for p, x in zip((q, k, v), g.split(list(QKV.values()))):
            p.grad = x.clone()
        opt.step()
    return torch.cat([q.detach(), k.detach(), v.detach()])


def test_fused_qkv_model_equals_separate_single_process():
    torch.manual_seed(0)
    fused = FusedAttn()
    sep = SeparateAttn(fused)
    groups = ds_muon.muon_param_groups(fused, lr=0.05)
    assert getattr(fused.qkv.weight, "_ds_muon_split_rows") == tuple(QKV.items())
    o_f = ds_muon.Muon(groups, momentum=0.9, ns_dtype=torch.float32)
    o_s = ds_muon.Muon(ds_muon.muon_param_groups(sep, lr=0.05), momentum=0.9, ns_dtype=torch.float32)
    x = torch.randn(5, D)
    for _ in range(STEPS):
        fused(x).square().mean().backward()
        for lin, gq in zip((sep.q, sep.k, sep.v), fused.qkv.weight.grad.split(list(QKV.values()))):
            lin.weight.grad = gq.clone()
        sep.out.weight.grad = fused.out.weight.grad.clone()
        o_f.step()
        o_s.step()
        o_f.zero_grad()
    assert torch.equal(fused.qkv.weight, torch.cat([sep.q.weight, sep.k.weight, sep.v.weight]))
    assert torch.equal(fused.out.weight, sep.out.weight)
    slots = o_f.runtime.bindings[id(fused.qkv.weight)].matrices
    assert [s.key for s in slots] == [f"qkv.weight[{k}]" for k in QKV]
    assert [s.matrix_shape for s in slots] == [(n, D) for n in QKV.values()]
    # without the split the scale and NS would be the fused matrix's: the test above can fail
    plain = nn.Parameter(_w0())
    tagged = ds_muon.split_rows(nn.Parameter(_w0()), dict(QKV))
    for p in (plain, tagged):
        p.grad = _qkv_grads(0)[0]
        ds_muon.Muon([p], **OPTS).step()
    assert not torch.equal(plain, tagged)


def test_expert_stack_equals_separate_experts_and_conv_rule_unchanged():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 12, 8, generator=g)
    stack = ds_muon.expert_weight(nn.Parameter(w.clone()))
    experts = [nn.Parameter(w[e].clone()) for e in range(3)]
    conv = nn.Parameter(w.clone())  # untagged 3-D: one [12·?] matrix, as before
    opts = [ds_muon.Muon([stack], **OPTS), ds_muon.Muon(experts, **OPTS), ds_muon.Muon([conv], **OPTS)]
    for t in range(2):
        grad = torch.randn(3, 12, 8, generator=g)
        stack.grad, conv.grad = grad.clone(), grad.clone()
        for e, p in enumerate(experts):
            p.grad = grad[e].clone()
        for o in opts:
            o.step()
    assert torch.equal(stack, torch.stack(experts))
    assert not torch.equal(conv, stack)
    assert [s.matrix_shape for s in opts[2].runtime.bindings[id(conv)].matrices] == [(3, 96)]
    assert [s.key for s in opts[0].runtime.bindings[id(stack)].matrices][:2] == ["param_groups[0]['params'][0][0]",
                                                                        "param_groups[0]['params'][0][1]"]


def test_multihead_attention_split_heads():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2)
    groups = ds_muon.muon_param_groups(mha, split_attention="heads")
    opt = ds_muon.Muon(groups)
    w = mha.in_proj_weight
    w.grad = torch.randn_like(w)
    mha.out_proj.weight.grad = torch.randn(8, 8)
    for p in groups[1]["params"]:
        p.grad = torch.zeros_like(p)
    opt.step()
    slots = opt.runtime.bindings[id(w)].matrices
    assert [s.key for s in slots] == [f"in_proj_weight[{c}{i}]" for c in "qkv" for i in range(2)]
    assert all(s.matrix_shape == (4, 8) for s in slots)
    with pytest.raises(ValueError, match="split_attention"):
        ds_muon.muon_param_groups(mha, split_attention="rows")


def test_bad_tags_raise_naming_the_parameter():
    p = nn.Parameter(torch.zeros(10, 4))
    ds_muon.split_rows(p, [4, 4])
    opt = ds_muon.Muon([{"params": [p], "param_names": ["blk.qkv"]}])
    p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match=r"blk\.qkv.*add up to 8 rows but the matrix has 10"):
        opt.step()
    with pytest.raises(ValueError, match="positive ints"):
        ds_muon.split_rows(nn.Parameter(torch.zeros(4, 4)), [4, 0])
    with pytest.raises(ValueError, match="partition_dim"):
        ds_muon.tensor_parallel(nn.Parameter(torch.zeros(4, 4)), None, 2)
    with pytest.raises(ValueError, match=r"\[E, out, in\]"):
        ds_muon.expert_weight(nn.Parameter(torch.zeros(4, 4)))

    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 6)
            self.ds_muon_row_blocks = {"lin.weight": [3, 2]}

    with pytest.raises(ValueError, match=r"lin\.weight.*add up to 5 rows but the matrix has 6"):
        opt = ds_muon.Muon(ds_muon.muon_param_groups(Bad()))
        for g in opt.param_groups:
            for q in g["params"]:
                q.grad = torch.zeros_like(q)
        opt.step()


def _split_worker(rank, world):
    """Replicated (DDP) and flat-sharded (ZeRO-like, cuts inside blocks) fused QKV."""
    w = _w0()
    rep = ds_muon.split_rows(nn.Parameter(w.clone()), dict(QKV))
    numel = w.numel()
    lo, hi = [(0, 100), (100, numel)][rank]  # rank 0 holds q whole and 4 rows of k; k is split
    flat = nn.Parameter(w.reshape(-1)[lo:hi].clone())
    flat._ds_muon_flat = True
    shaped = ds_muon.split_rows(torch.empty(w.shape, device="meta"), dict(QKV))  # tags only
    # planner="locality": one home per block (the default "auto" may duplicate NS on the replicated copy)
    o_rep = ds_muon.Muon([{"params": [rep], "param_names": ["qkv"]}], planner="locality", **OPTS)
    o_flat = ds_muon.Muon([{"params": [flat], "param_names": ["qkv"]}], adapter=HandAdapter(
        lambda p, n, context: ParamBinding(p, lambda t: t.reshape(-1), block_slots(shaped, n, lo, hi))), **OPTS)
    counts = []
    for t in range(STEPS):
        g, _ = _qkv_grads(t)
        rep.grad = g.clone()
        flat.grad = g.reshape(-1)[lo:hi].clone()
        if t == STEPS - 1:
            counts = [_count(o.step) for o in (o_rep, o_flat)]
        else:
            o_rep.step()
            o_flat.step()
    homes = sorted(h for ex in o_rep.exchanges() for (h,) in ex.homes.values())
    return rep.detach(), (lo, hi), flat.detach(), counts, homes


def test_fused_qkv_sharded_equals_separate_w2():
    ref = _separate_reference()
    results = dist_harness.run(_split_worker, 2, timeout=120)
    full = torch.empty(ref.numel())
    for rep, (lo, hi), flat, counts, homes in results:
        assert torch.equal(rep, ref)
        full[lo:hi] = flat
        assert counts[0] == 1 and counts[1] == 2, counts  # replicated: scatter only; sharded: one each way
        assert homes == [0, 0, 1] or homes == [0, 1, 1], homes  # blocks of one tensor on different homes
    assert torch.equal(full.view_as(ref), ref)


# -- collectives by group ---------------------------------------------------------
def _count(step):
    """Run ``step`` and return the all_to_all calls it made, as a list of group rank tuples
    (a plain number when every call went to one group)."""
    calls = []
    real = dist.all_to_all_single

    def spy(*a, group=None, **k):
        calls.append(tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)))
        return real(*a, group=group, **k)

    dist.all_to_all_single = spy
    try:
        step()
    finally:
        dist.all_to_all_single = real
    return len(calls) if len(set(calls)) <= 1 else sorted(calls)


# -- tensor parallelism -------------------------------------------------------------
COL, ROW, REP = (16, 8), (8, 16), (12, 8)  # column-parallel [out, in], row-parallel [out, in], replicated


def _tp_init():
    g = torch.Generator().manual_seed(11)
    return [torch.randn(s, generator=g) * 0.2 for s in (COL, ROW, REP)]


def _tp_grads(step):
    g = torch.Generator().manual_seed(700 + step)
    return [torch.randn(s, generator=g) for s in (COL, ROW, REP)]


@_one_thread
def _tp_reference():
    ps = [nn.Parameter(w) for w in _tp_init()]
    opt = ds_muon.Muon(ps, **OPTS)
    for t in range(STEPS):
        for p, g in zip(ps, _tp_grads(t)):
            p.grad = g
        opt.step()
    return [p.detach() for p in ps]


def _shard(w, tp, k, dim):
    return w.chunk(tp, dim=dim)[k].contiguous()


def _tp_worker(rank, world):
    groups = {4: dist.new_group([0, 1, 2, 3]), 2: [dist.new_group([0, 1]), dist.new_group([2, 3])]}
    out = {}
    for tp in (4, 2):  # TP=4 alone; TP=2 × DP=2 (replicas of TP rank k on ranks k and k+2)
        tp_group = groups[4] if tp == 4 else groups[2][rank // 2]
        k = dist.get_rank(tp_group)
        col, row, rep = _tp_init()
        ps = [ds_muon.tensor_parallel(nn.Parameter(_shard(col, tp, k, 0)), tp_group, 0),
              ds_muon.tensor_parallel(nn.Parameter(_shard(row, tp, k, 1)), tp_group, 1),
              nn.Parameter(rep)]
        opt = ds_muon.Muon([{"params": ps, "param_names": ["col", "row", "rep"]}], **OPTS)
        counts = None
        for t in range(STEPS):
            g = _tp_grads(t)
            for p, gr, dim in zip(ps, g, (0, 1, None)):
                p.grad = gr.clone() if dim is None else _shard(gr, tp, k, dim)
            if t == STEPS - 1:
                counts = _count(opt.step)
            else:
                opt.step()
        shapes = [s.matrix_shape for p in ps for s in opt.runtime.bindings[id(p)].matrices]
        out[tp] = (k, [p.detach() for p in ps], counts, shapes, len(opt.runtime.layouts))
    return out


def test_tensor_parallel_column_and_row_w4():
    ref = _tp_reference()
    results = dist_harness.run(_tp_worker, 4, timeout=180)
    for rank, res in enumerate(results):
        for tp in (4, 2):
            k, (col, row, rep), counts, shapes, layouts = res[tp]
            assert k == (rank if tp == 4 else rank % 2)
            assert torch.equal(col, _shard(ref[0], tp, k, 0))
            assert torch.equal(row, _shard(ref[1], tp, k, 1))
            assert torch.equal(rep, ref[2])
            # the logical (and scaling) shape is the global one, not the shard's nor global × world
            assert shapes == [COL, ROW, REP], shapes
            assert layouts == 1 and counts == 2, (tp, counts)  # one Layout, one fused exchange each way
    # TP scaling must use the global shape: shape_scaling of the shard would give 1, not sqrt(2)
    assert ds_muon.get_muon_scale_factor(*COL) == math.sqrt(2)


# -- MoE domains (plain PyTorch) -------------------------------------------------------
E, OUT, IN = 4, 12, 8  # 4 experts [12, 8]; EP=2 (2 experts per rank), EDP=2
DENSE = (8, 8)


def _moe_init():
    g = torch.Generator().manual_seed(21)
    return (torch.randn(DENSE, generator=g) * 0.2, torch.randn(E, OUT, IN, generator=g) * 0.2,
            torch.randn(E, OUT, generator=g) * 0.1)


def _moe_grads(step):
    g = torch.Generator().manual_seed(900 + step)
    return torch.randn(DENSE, generator=g), torch.randn(E, OUT, IN, generator=g), torch.randn(E, OUT, generator=g)


@_one_thread
def _moe_reference():
    dense, experts, bias = (nn.Parameter(x) for x in _moe_init())
    ds_muon.expert_weight(experts)
    opt = ds_muon.Muon([{"params": [dense, experts]}, {"params": [bias], "use_muon": False, "lr": 1e-2}], **OPTS)
    for t in range(STEPS):
        for p, g in zip((dense, experts, bias), _moe_grads(t)):
            p.grad = g
        opt.step()
    return dense.detach(), experts.detach(), bias.detach()


def _moe_worker(rank, world):
    # expert parallel groups [0, 1], [2, 3]; expert data parallel groups [0, 2], [1, 3]
    edp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep_rank, edp_rank = rank % 2, rank // 2
    edp = edp_groups[ep_rank]
    mine = slice(2 * ep_rank, 2 * ep_rank + 2)  # this EP rank's experts
    dense0, experts0, bias0 = _moe_init()
    local = experts0[mine].reshape(-1)
    lo, hi = [(0, 100), (100, local.numel())][edp_rank]  # experts sharded over EDP, one expert split
    dense = nn.Parameter(dense0)
    experts = nn.Parameter(local[lo:hi].clone())
    experts._ds_muon_flat = True
    setattr(experts, EXPERTS, True)
    ds_muon.domain(experts, edp)
    bias = ds_muon.domain(nn.Parameter(bias0[mine].clone()), edp)
    shape = (2, OUT, IN)

    def describe(p, name, context):
        if p is experts:
            return ParamBinding(p, lambda t: t.reshape(-1), block_slots(p, name, lo, hi, 0, shape), group=edp)
        return bind_replicated(p, name, context.process_group)

    opt = ds_muon.Muon([{"params": [dense, experts], "param_names": ["dense", "experts"]},
                        {"params": [bias], "param_names": ["experts.bias"], "use_muon": False, "lr": 1e-2}],
                       adapter=HandAdapter(describe), planner="locality", **OPTS)  # one home: collectives counted

    def set_grads(t, skip_experts=False):
        gd, ge, gb = _moe_grads(t)
        dense.grad = gd
        experts.grad = None if skip_experts else ge[mine].reshape(-1)[lo:hi].clone()
        bias.grad = None if skip_experts else gb[mine].clone()

    counts = None
    for t in range(STEPS):
        set_grads(t)
        if t == STEPS - 1:
            counts = _count(opt.step)
        else:
            opt.step()
    out = {"params": (dense.detach().clone(), experts.detach().clone(), bias.detach().clone()), "lohi": (lo, hi),
           "counts": counts, "layouts": sorted((lay.world_size, len(lay.matrices)) for lay in opt.runtime.layouts),
           # every world rank steps this optimizer, so the expert domains' exchanges get groups of their own too
           "own_groups": all(ex.group is not ex.layout.group and dist.get_process_group_ranks(ex.group)
                             == dist.get_process_group_ranks(ex.layout.group or dist.group.WORLD)
                             for ex in opt.exchanges())}
    # experts of EP rank 1 got no tokens (no grad on either replica): they are skipped, nothing raises
    before = experts.detach().clone()
    set_grads(STEPS, skip_experts=ep_rank == 1)
    opt.step()
    out["skipped_unchanged"] = torch.equal(before, experts) == (ep_rank == 1)
    # replicas of one expert disagree (rank 0 has a grad, rank 2 has none): every rank raises
    set_grads(STEPS + 1, skip_experts=rank == 2)
    before = [p.detach().clone() for p in (dense, experts, bias)]
    try:
        opt.step()
        out["mismatch"] = None
    except RuntimeError as e:
        out["mismatch"] = str(e)
    # a non-finite expert gradient on rank 3 stops the step everywhere
    set_grads(STEPS + 1)
    bias.grad[0, 0] = float("nan") if rank == 3 else bias.grad[0, 0]
    try:
        opt.step()
        out["nan"] = None
    except FloatingPointError as e:
        out["nan"] = str(e)
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(before, (dense, experts, bias)))
    return out


def test_moe_domains_parity_and_agreement_w4():
    ref_dense, ref_experts, ref_bias = _moe_reference()
    results = dist_harness.run(_moe_worker, 4, timeout=180)
    for rank, r in enumerate(results):
        ep_rank = rank % 2
        dense, experts, bias = r["params"]
        lo, hi = r["lohi"]
        assert torch.equal(dense, ref_dense)
        assert torch.equal(experts, ref_experts[2 * ep_rank:2 * ep_rank + 2].reshape(-1)[lo:hi])
        assert torch.equal(bias, ref_bias[2 * ep_rank:2 * ep_rank + 2])
        edp = (ep_rank, ep_rank + 2)
        # dense domain: replicated, results scattered once; expert domain: one exchange each way
        assert r["counts"] == sorted([(0, 1, 2, 3), edp, edp]), r["counts"]
        assert r["layouts"] == [(2, 2), (4, 1)], r["layouts"]
        assert r["own_groups"]
        assert r["skipped_unchanged"]
        assert r["mismatch"] and "experts" in r["mismatch"] and "domain of ranks [0, 2]" in r["mismatch"]
        assert "gradient on 1 rank(s) and none on 1" in r["mismatch"]
        assert r["nan"] and "experts.bias (domain of ranks [1, 3])" in r["nan"]
        assert r["untouched"]


# -- DeepSpeed MoE ------------------------------------------------------------------
def _ds_moe_worker(rank, world):
    from deepspeed.moe.layer import MoE

    from ds_muon import deepspeed as ds_muon_deepspeed

    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.inp = nn.Linear(8, 8)
            self.moe = MoE(hidden_size=8, expert=nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8)),
                           num_experts=4, ep_size=2, k=1, min_capacity=16, capacity_factor=4.0)
            self.head = nn.Linear(8, 16)

        def forward(self, x, y):
            h = self.inp(self.emb(x))
            o, aux, _ = self.moe(h)
            logits = self.head(h + o)
            return nn.functional.cross_entropy(logits.reshape(-1, 16), y.reshape(-1)) + 0.01 * aux

    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0,
           "optimizer": {"type": "DsMuon", "params": {"lr": 0.02, "adam_lr": 3e-3}}}
    engine, _, _, _ = ds_muon_deepspeed.initialize(model=Model(), config=cfg)
    muon = ds_muon.find_muon(engine)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 16, (4, 8), generator=g)
    y = (3 * x + 1) % 16
    losses = []
    for _ in range(10):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    layouts = sorted({(lay.world_size, len(lay.matrices)) for _, lays in muon.runtime.resolved.values() for lay in lays})
    tagged = sum(1 for p in engine.module.parameters() if getattr(p, "_ds_muon_domain", None) is not None)
    return losses, layouts, tagged


def test_deepspeed_moe_trains_w4():
    pytest.importorskip("deepspeed")
    results = dist_harness.run(_ds_moe_worker, 4, timeout=240, env={"DS_ACCELERATOR": "cpu",
                                                                    "TORCHDYNAMO_DISABLE": "1"})
    for losses, layouts, tagged in results:
        assert losses[-1] < losses[0] - 0.2, losses
        # ZeRO-2 partitions dense matrices over the 4 data-parallel ranks and each expert's
        # matrices over its 2 expert data-parallel ranks: one Layout per domain
        assert (4, 2) in layouts and (2, 4) in layouts, layouts
        assert tagged == 8  # 2 local experts × (2 weights + 2 biases)

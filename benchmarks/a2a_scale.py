"""all_to_all_single over the whole group against batched point-to-point with only the ranks
each rank really talks to (the two transports of :class:`ds_muon.engine.exchange.all_to_all.Exchange`).

Sparse patterns: rank r sends ``elems`` floats to each of r+1..r+k and receives from
r-1..r-k (mod W); every other split is zero.  For each world size (gloo ranks on this
machine, one thread each) and k, both transports run in the same processes, alternating
per repeat, and the slowest rank's median per call is reported in wall time and in process
CPU time (the machine is shared: wall swings, CPU time much less).  Then the planner's model
(:meth:`ds_muon.engine.plan.cost_model.CostModel.transport_seconds`) at W = 1k-10k.

What a few CPU processes cannot show: NCCL's per-peer cost of an all_to_all, its
connections (one per peer, each with its own buffers) and the network at thousands of ranks.
The measured columns show gloo's per-call overhead against peers talked to; the model
columns are assumptions (CostModel defaults), not measurements.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from common import header, table

import dist_harness
from ds_muon.engine.plan.cost_model import CostModel


def _pattern(rank: int, world: int, k: int, elems: int):
    send = [elems if 0 < (p - rank) % world <= k else 0 for p in range(world)]
    recv = [elems if 0 < (rank - p) % world <= k else 0 for p in range(world)]
    return send, recv


def _a2a(out, inp, split_recv, split_send):
    dist.all_to_all_single(out, inp, split_recv, split_send)


def _p2p(out, inp, split_recv, split_send):
    ops = [dist.P2POp(dist.irecv, t, p) for p, t in enumerate(out.split(split_recv)) if t.numel()]
    ops += [dist.P2POp(dist.isend, t, p) for p, t in enumerate(inp.split(split_send)) if t.numel()]
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()


def _worker(rank, world, ks, elems, calls, repeats):
    out = {}
    for k in ks:
        split_send, split_recv = _pattern(rank, world, k, elems)
        inp = torch.full((sum(split_send),), float(rank))
        res = torch.empty(sum(split_recv))
        check = {}
        for name, fn in (("all_to_all", _a2a), ("p2p", _p2p)):  # warm up; same bytes either way
            fn(res, inp, split_recv, split_send)
            check[name] = res.clone()
        assert torch.equal(check["all_to_all"], check["p2p"])
        times = {"all_to_all": ([], []), "p2p": ([], [])}
        for _ in range(repeats):
            for name, fn in (("all_to_all", _a2a), ("p2p", _p2p)):
                dist.barrier()
                w0, c0 = time.perf_counter(), time.process_time()
                for _ in range(calls):
                    fn(res, inp, split_recv, split_send)
                times[name][0].append((time.perf_counter() - w0) / calls)
                times[name][1].append((time.process_time() - c0) / calls)
        out[k] = {n: (statistics.median(w), statistics.median(c)) for n, (w, c) in times.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--elems", type=int, default=1024, help="floats per nonzero split")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model-worlds", type=int, nargs="+", default=[8, 64, 1024, 4096, 10240])
    ap.add_argument("--model-peers", type=int, nargs="+", default=[2, 16, 128])
    args = ap.parse_args()
    header("all_to_all vs batched p2p, sparse exchange (gloo, CPU)")
    rows = []
    for world in args.worlds:
        ks = sorted({1, world - 1})
        per_rank = dist_harness.run(_worker, world, ks, args.elems, args.calls, args.repeats, timeout=1800)
        for k in ks:
            slow = {n: tuple(max(r[k][n][j] for r in per_rank) for j in (0, 1)) for n in ("all_to_all", "p2p")}
            a, p = slow["all_to_all"], slow["p2p"]
            rows.append([world, k, args.elems * 4, a[0] * 1e6, p[0] * 1e6, p[0] / a[0], a[1] * 1e6, p[1] * 1e6,
                         p[1] / a[1]])
    table(["W", "peers k", "bytes/peer", "a2a wall µs", "p2p wall µs", "p2p/a2a wall", "a2a CPU µs", "p2p CPU µs",
           "p2p/a2a CPU"], rows)
    cm = CostModel(exchange="auto")
    print(f"model (CostModel defaults: all_to_all {cm.a2a_peer_s * 1e6:g} µs per rank of the group, "
          f"p2p {cm.p2p_peer_s * 1e6:g} µs per send or receive; latency only, bytes are equal)")
    mrows = []
    for world in args.model_worlds:
        for peers in args.model_peers:
            if peers >= world:
                continue
            t = cm.transport_seconds(world, peers)
            mrows.append([world, peers, t["all_to_all"] * 1e6, t["p2p"] * 1e6, cm.transport(world, peers),
                          world - 1, peers])
    table(["W", "peers", "a2a µs", "p2p µs", "auto picks", "a2a connections/rank", "p2p connections/rank"], mrows)


if __name__ == "__main__":
    main()

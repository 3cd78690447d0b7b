"""DeepSpeed's CPU Adam against torch's AdamW on host tensors: how far apart, and how fast.

ds_muon steps the AdamW tensors of an offloaded run with torch's functional AdamW (bitwise the
run without offload); DeepSpeed users may expect DeepSpeedCPUAdam there.  This prints, in one
run, the largest differences of the parameters after N steps of each (same gradients, same
hyper-parameters, fp32) and the wall and process CPU time per step of each.

    DS_ACCELERATOR=cpu python benchmarks/cpu_adam_parity.py [--numel 4194304] [--steps 20]
"""

import argparse
import time

import torch
from torch.optim._functional import adamw as functional_adamw


def torch_adamw(p, g, m, v, step, lr, betas, eps, wd):
    functional_adamw([p], [g], [m], [v], [], [step], foreach=False, amsgrad=False, beta1=betas[0], beta2=betas[1],
                     lr=lr, weight_decay=wd, eps=eps, maximize=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1 << 22)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    lr, betas, eps, wd = 3e-3, (0.9, 0.95), 1e-8, 0.01
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(args.numel, generator=gen) * 0.02
    grads = [torch.randn(args.numel, generator=gen) * 10.0 ** float(k % 5 - 4) for k in range(args.steps)]

    p_t = init.clone()
    m, v, step = torch.zeros_like(p_t), torch.zeros_like(p_t), torch.tensor(0.0)
    p_d = torch.nn.Parameter(init.clone())
    ds = DeepSpeedCPUAdam([p_d], lr=lr, betas=betas, eps=eps, weight_decay=wd, adamw_mode=True)
    times = {"torch AdamW": [0.0, 0.0], "DeepSpeedCPUAdam": [0.0, 0.0]}
    first_diff = None
    for k, g in enumerate(grads):
        w, c = time.perf_counter(), time.process_time()
        torch_adamw(p_t, g, m, v, step, lr, betas, eps, wd)
        times["torch AdamW"][0] += time.perf_counter() - w
        times["torch AdamW"][1] += time.process_time() - c
        p_d.grad = g.clone()
        w, c = time.perf_counter(), time.process_time()
        ds.step()
        times["DeepSpeedCPUAdam"][0] += time.perf_counter() - w
        times["DeepSpeedCPUAdam"][1] += time.process_time() - c
        if first_diff is None and not torch.equal(p_t, p_d.detach()):
            first_diff = k + 1
    diff = (p_t - p_d.detach()).abs()
    moved = (p_t - init).abs()
    print(f"{args.numel} fp32 elements, {args.steps} steps, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"bitwise equal: {torch.equal(p_t, p_d.detach())} (first difference after step {first_diff})")
    print(f"elements that differ: {int((diff > 0).sum())} of {args.numel}")
    print(f"max |diff| {float(diff.max()):.3g}; max |diff| / max |update| {float(diff.max() / moved.max()):.3g}; "
          f"mean |diff| / mean |update| {float(diff.mean() / moved.mean()):.3g}")
    print("| optimizer | wall ms/step | CPU ms/step |")
    print("|---|---|---|")
    for name, (wall, cpu) in times.items():
        print(f"| {name} | {wall / args.steps * 1e3:.2f} | {cpu / args.steps * 1e3:.2f} |")
    print(f"wall ratio torch/DeepSpeed: {times['torch AdamW'][0] / times['DeepSpeedCPUAdam'][0]:.2f}")


if __name__ == "__main__":
    main()

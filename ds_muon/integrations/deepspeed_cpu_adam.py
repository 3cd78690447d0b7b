"""DeepSpeed's CPU Adam kernel for Muon's AdamW tensors in host memory (opt-in).

ds_muon steps its AdamW tensors with torch's functional AdamW, with or without offload,
so an offloaded run is bitwise the run without.  DeepSpeed's CPU Adam (AVX, several
threads) is faster on host tensors but rounds differently: measured here, 1 ulp-level
differences from the first step (benchmarks/cpu_adam_parity.py, docs/DEEPSPEED.md).  Opt in
with ``"adam_kernel": "deepspeed_cpu"`` in the DsMuon entry, or
``muon.adamw_kernel = DeepSpeedCPUAdamKernel()``.

The kernel keeps no state of its own: moments and step counts stay in Muon's state (the
same keys as torch's AdamW), so checkpoints move freely between the two kernels.
"""

from __future__ import annotations

import itertools
from typing import List

import torch
from torch.optim._functional import adamw as functional_adamw

KERNELS = ("torch", "deepspeed_cpu")
_ids = itertools.count(10_000)  # DeepSpeedCPUAdam numbers its optimizers from 0
_op = None


def _load_op():
    """DeepSpeed's cpu_adam extension (built by DeepSpeed on first use, then cached)."""
    global _op
    if _op is None:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        _op = CPUAdamBuilder().load()
    return _op


class DeepSpeedCPUAdamKernel:
    """Has the signature of ``torch.optim._functional.adamw``; fp32 host tensors step through
    DeepSpeed's ``adam_update``, anything else through torch's AdamW."""

    def __init__(self):
        self.op = _load_op()
        self.opt_id = next(_ids)
        self.op.create_adam(self.opt_id, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False)

    def __call__(self, params: List[torch.Tensor], grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *,
                 amsgrad: bool, beta1: float, beta2: float, lr: float, weight_decay: float, eps: float,
                 maximize: bool, foreach=None, **kw) -> None:
        rest = [k for k, p in enumerate(params) if not _host_fp32(p, grads[k], exp_avgs[k], exp_avg_sqs[k])]
        if amsgrad or maximize:
            rest = list(range(len(params)))
        if rest:
            pick = lambda xs: [xs[k] for k in rest]  # noqa: E731
            functional_adamw(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                             pick(max_exp_avg_sqs) if max_exp_avg_sqs else [], pick(state_steps), foreach=foreach,
                             amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
                             maximize=maximize, **kw)
        skip = set(rest)
        for k, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, state_steps)):
            if k in skip:
                continue
            step += 1
            self.op.adam_update(self.opt_id, int(step.item()), float(lr), beta1, beta2, eps, weight_decay, True,
                                p.view(-1), g.contiguous().view(-1), m.view(-1), v.view(-1))

    def __deepcopy__(self, memo):
        return DeepSpeedCPUAdamKernel()

    def __reduce__(self):
        return (DeepSpeedCPUAdamKernel, ())

    def __repr__(self) -> str:
        return "DeepSpeedCPUAdamKernel()"


def _host_fp32(*tensors) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def adamw_kernel(name: str):
    """The AdamW kernel named ``name`` ("torch": None, i.e. torch's functional AdamW)."""
    if name not in KERNELS:
        raise ValueError(f'ds_muon: "adam_kernel" {name!r} is unknown; use one of {list(KERNELS)} ("torch" is '
                         "bitwise the run without offload; \"deepspeed_cpu\" is DeepSpeed's faster CPU Adam, not "
                         "bitwise torch's)")
    return None if name == "torch" else DeepSpeedCPUAdamKernel()

"""A check of one rank's own input that must fail on every rank (:class:`LocalFailure`), carried
through the agreement's all_reduce instead of raised at once.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch.distributed as dist


class LocalFailure:
    """A ds_muon check of this rank's own input, before the step's agreement, that must fail on
    every rank: a setting edited into one rank's ``param_groups``, a state loaded on one rank that
    does not fit, a sparse gradient.  Raised at once on that rank alone, it would leave the others
    waiting in the agreement's all_reduce until the group's timeout.  Instead the rank goes on to
    the agreement (writing nothing) and flags it in the table; after the sum the failing ranks
    re-raise their own error and the others raise one of the same type naming them (their
    messages gathered only then).  The good path costs no collective.
    """

    KINDS = (ValueError, TypeError, RuntimeError)  # what ds_muon's checks raise

    @staticmethod
    def catch(check: Callable[[], Any]) -> Optional[Exception]:
        """Run ``check``: its error is returned to be carried to the agreement when other ranks may
        be waiting there (a process group is up), raised at once otherwise (one process)."""
        try:
            check()
        except LocalFailure.KINDS as e:
            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
                raise
            return e
        return None

    @staticmethod
    def raise_everywhere(failed: Optional[Exception], group, world: int) -> None:
        """After the sum, on every rank: some rank flagged a failed check."""
        mine = None if failed is None else (type(failed), str(failed))
        everyone: List[Any] = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
        if failed is not None:
            raise failed
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        bad = [(r, e) for r, e in zip(ranks, everyone) if e is not None]
        kind = next((k for k in LocalFailure.KINDS if issubclass(bad[0][1][0], k)), RuntimeError)
        raise kind(
            f"ds_muon: a check before the step failed on rank(s) {[r for r, _ in bad]}; nothing was changed on any "
            "rank. " + "; ".join(f"rank {r}: {message}" for r, (_, message) in bad))

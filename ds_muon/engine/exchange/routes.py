"""Routes: which rank sends each piece to a home, and which home sends each result back.

With several homes of one matrix (HSDP replica groups, DDP's duplicated NS) a home gathers inside its own
replica group and each holder gets its result from the home in its group, so no piece crosses between
replica groups.  The exchange (:mod:`.all_to_all`) builds its index maps from these; the planner
(:func:`~ds_muon.engine.plan.cost_model.pair_traffic`) counts the same traffic when it chooses homes.
"""

from __future__ import annotations

from typing import Sequence, Tuple


def replica_groups(piece_holders: Sequence[Sequence[int]]) -> Tuple[Tuple[int, ...], ...]:
    """Replica groups of one matrix (HSDP) from the ranks holding each of its distinct pieces.

    When there are several distinct pieces and each is held by the same number R > 1 of
    ranks, the j-th holder (in rank order) of every piece forms group j: R disjoint groups,
    each holding the whole matrix between its ranks.  ``()`` otherwise (no replicas, or
    whole copies as in DDP, where each rank is a group of its own: the planner's whole holders).
    """
    holders = [sorted(h) for h in piece_holders]
    if len(holders) < 2 or len({len(h) for h in holders}) != 1 or len(holders[0]) < 2:
        return ()
    groups = tuple(tuple(sorted(h[j] for h in holders)) for j in range(len(holders[0])))
    ranks = [r for g in groups for r in g]
    return groups if len(set(ranks)) == len(ranks) else ()


def replica_group_of(groups, rank: int) -> Tuple[int, ...]:
    return next((g for g in groups if rank in g), ())


def gather_source(holders: Sequence[int], home: int, homes: Sequence[int], groups, default: int) -> int:
    """The holder that sends ``home`` a piece held by ``holders``: with several homes, one in the
    home's own replica group when there is one (each group's home gathers inside its group),
    else ``default`` (the exchange's spread over replicas)."""
    if len(homes) > 1:
        mine = replica_group_of(groups, home)
        for r in holders:
            if r in mine:
                return r
    return default


def scatter_source(homes: Sequence[int], d: int, groups) -> int:
    """The home that sends rank ``d`` its result: with several homes, the one in ``d``'s replica
    group when there is one (no traffic between replica groups), else ``homes[d % len(homes)]``."""
    if len(homes) > 1:
        mine = replica_group_of(groups, d)
        for h in homes:
            if h in mine:
                return h
    return homes[d % len(homes)]

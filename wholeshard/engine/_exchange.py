"""The exchange of an exchange buffer's matrices between the shards that hold them and the ranks
that own them ([Note: exchange buffers] in `planning._exchange`).

After a batch of units is reduced (each rank's shard summed and averaged), one all-to-all sends
every piece of a matrix that this rank's shard holds to the matrix's owner, in the grad dtype,
where it lands in the owner's storage of the whole matrix (`StorageUnit.owned_views`); after the
update, one all-to-all sends the owners' updated pieces back to the holders' shards, in the param
dtype, before the units' gathers. Each direction moves exactly `planning.sync.exchange`'s sizes:
the pieces each rank sends to a peer are packed in buffer order, peers ascending, and unpacked
in the same order, so no sizes travel. Zero-size peers are left out of the split sizes' effect
(nothing moves), and a batch in which no rank moves anything still issues its all-to-all on every
rank, so every rank issues the same collectives. Fully sharded, an owner's matrices live in
copies apart from its shards ([Note: owned copies] in `_owned_copies`): the pieces its own shard
holds are copied there beside the all-to-all each way (`Moves.local`); the grad copies (and,
where the optimizer keeps masters, the param copies) get their storage as the grads come in
(`StorageUnit.owned_views`) and lose it as the params go back, so a step that already sent them
back cannot read them again before `zero_grad()` (`check_grads`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor
from torch.distributed import ProcessGroup

from ..distributed import collectives
from ..planning import Buffer, Segment, pieces
from ..planning.sync import exchange_batches
from ._storage import StorageUnit


@dataclass(frozen=True)
class _Piece:
    """One segment as this rank moves it: its unit and buffer range, and the peer."""

    peer: int
    unit: StorageUnit
    start: int
    end: int


@dataclass(frozen=True)
class Moves:
    """The units one all-to-all each way serves, and this rank's pieces of it: `held` (in its
    shard, owned by a peer) and `owned` (of its matrices, held by a peer), each sorted by
    (peer, start); `local` (in its shard, of its matrices, where these have owned copies);
    per peer, the elements of each."""

    units: tuple[StorageUnit, ...]
    held: tuple[_Piece, ...]
    owned: tuple[_Piece, ...]
    local: tuple[_Piece, ...]
    held_splits: tuple[int, ...]
    owned_splits: tuple[int, ...]


class Exchange:
    """The exchanges of one sharded group's exchange buffer, for shard index `rank` of `size` on
    `group` (peers by `group_rank` of their shard index): `units` are the buffer's storage
    units (one per bucket, buffer order);
    `every`: buckets per batch (None: one batch per step)."""

    def __init__(
        self,
        buffer: Buffer,
        units: Sequence[StorageUnit],
        rank: int,
        size: int,
        group: ProcessGroup | None,
        every: int | None,
        group_rank: Callable[[int], int],
    ) -> None:
        self.group = group
        self._landing: list[collectives.AllToAll] = []  # dispatched to the owners, in order
        self._landed = 0  # of those, waited for
        # The step sent every batch's params back, freeing the owned grad copies (fully
        # sharded) that this window's exchange filled.
        self.grads_freed = False
        if [u.buckets for u in units] != [(b,) for b in buffer.buckets]:
            raise AssertionError("an exchange buffer's units are its buckets, in buffer order")
        by_bucket: dict[int, list[Segment]] = {}
        for s in pieces(buffer):
            by_bucket.setdefault(s.bucket, []).append(s)
        self.batches = [
            moves(
                [units[b] for b in batch],
                [s for b in batch for s in by_bucket.get(b, ())],
                units.__getitem__,
                rank,
                size,
                group_rank,
            )
            for batch in exchange_batches(len(buffer.buckets), every)
        ]

    def dispatch(self, last_unit: int) -> None:
        """Dispatch the exchange to the owners of every batch whose units are all among the
        first `last_unit` + 1, not yet dispatched, each once its units' reductions finished
        (on CUDA a stream's wait, not the host's). The scheduler calls it before it reduces
        unit `last_unit` + 1, so every rank issues a batch's exchange between the reductions
        of its last unit and of the next batch's first, in backward or at the step alike."""
        while len(self._landing) < len(self.batches):
            batch = self.batches[len(self._landing)]
            if batch.units[-1].index > last_unit:
                return
            for unit in batch.units:
                unit.finish_reduce()
            self._landing.append(self.grads_to_owners(batch))

    def grads(self, through: int | None = None) -> None:
        """Dispatch what is left of the exchanges to the owners of batches 0..`through` (None:
        every batch), each once its units are reduced, and wait for them."""
        last = len(self.batches) - 1 if through is None else through
        self.dispatch(self.batches[last].units[-1].index)
        _wait(self._landing[self._landed : last + 1], "the exchange of reduced gradients")
        self._landed = max(self._landed, last + 1)

    def reset(self) -> None:
        """A new accumulation window: wait for any exchange still in flight (it writes the
        grads about to be zeroed), then forget them."""
        _wait(self._landing[self._landed :], "the exchange of reduced gradients")
        self._landing, self._landed = [], 0
        self.grads_freed = False

    def check_grads(self) -> None:
        """Raise (on every rank alike) if the owned grads were freed by this window's step."""
        if self.grads_freed:
            raise RuntimeError(
                "the gradients were already used by optimizer.step(), which, fully sharded on "
                "the exchange strategy, frees each owner's whole-matrix copies of them: call "
                "optimizer.zero_grad() and run a backward before the next step() or "
                "clip_grad_norm_()"
            )

    def params(self, batch: int | None = None) -> None:
        """Send the owners' updated pieces of batch `batch` (None: every batch) back to their
        holders."""
        todo = self.batches if batch is None else [self.batches[batch]]
        landing = [self.params_to_holders(b) for b in todo]
        _wait(landing, "the exchange of updated params to their holders")
        copies = self.batches[-1].units[-1].owned_copies is not None
        self.grads_freed = copies and bool(self._landing) and todo[-1] is self.batches[-1]

    def grads_to_owners(self, batch: Moves) -> collectives.AllToAll:
        """Dispatch the batch's reduced pieces to their owners (the batch's units reduced)."""
        return self._move(batch, to_owners=True)

    def params_to_holders(self, batch: Moves) -> collectives.AllToAll:
        """Dispatch the owners' updated pieces of the batch back to the shards holding them."""
        return self._move(batch, to_owners=False)

    def _move(self, batch: Moves, to_owners: bool) -> collectives.AllToAll:
        """Grads from the holders' shards to the owners' matrices (`to_owners`), or params back:
        the pieces this rank both holds and owns by a copy, the rest by one all-to-all."""

        def held(p: _Piece) -> Tensor:
            return p.unit.held_views(p.start, p.end)[1 if to_owners else 0]

        def owned(p: _Piece) -> Tensor:
            if to_owners:
                return p.unit.owned_views(p.start, p.end)[1]
            return p.unit.owned_param(p.start, p.end)

        src, dst = (held, owned) if to_owners else (owned, held)
        sent, got = (batch.held, batch.owned) if to_owners else (batch.owned, batch.held)
        splits = (batch.held_splits, batch.owned_splits)
        for p in batch.local:
            dst(p).copy_(src(p))
        moving = collectives.all_to_all(
            [src(p) for p in sent],
            [dst(p) for p in got],
            *(splits if to_owners else splits[::-1]),
            self.group,
            like=(batch.units[0].grad if to_owners else batch.units[0].param),
        )
        if not to_owners:  # the update has read the batch's owned grads (and sent the params)
            for unit in batch.units:
                unit.free_owned()
        return moving


def moves(
    units: Sequence[StorageUnit],
    segs: Sequence[Segment],
    unit_of: Callable[[int], StorageUnit],
    rank: int,
    size: int,
    group_rank: Callable[[int], int],
) -> Moves:
    """What shard index `rank` of `size` moves of `segs` (pieces of the matrices of `units`;
    `unit_of(bucket)` holds each), in the order every rank packs and unpacks them: by peer, the
    shard group's rank (`group_rank` of a shard index: [Note: two-level groups] in
    `planning.plan`), then by start."""
    held = [
        _Piece(group_rank(s.owner), unit_of(s.bucket), s.start, s.end)
        for s in segs
        if s.holder == rank != s.owner
    ]
    owned = [
        _Piece(group_rank(s.holder), unit_of(s.bucket), s.start, s.end)
        for s in segs
        if s.owner == rank != s.holder
    ]
    local = [
        _Piece(group_rank(rank), unit_of(s.bucket), s.start, s.end)
        for s in segs
        if s.holder == rank == s.owner and unit_of(s.bucket).owned_copies is not None
    ]
    held.sort(key=lambda p: (p.peer, p.start))
    owned.sort(key=lambda p: (p.peer, p.start))
    return Moves(
        tuple(units),
        tuple(held),
        tuple(owned),
        tuple(local),
        _splits(held, size),
        _splits(owned, size),
    )


def _splits(pieces: Sequence[_Piece], size: int) -> tuple[int, ...]:
    """Elements per peer (group rank) of `pieces`."""
    out = [0] * size
    for p in pieces:
        out[p.peer] += p.end - p.start
    return tuple(out)


def _wait(handles: Sequence[collectives.AllToAll], what: str) -> None:
    with collectives.naming(what):
        for h in handles:
            h.wait()

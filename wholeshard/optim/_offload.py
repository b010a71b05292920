"""`StateOffload`: how `LayerwiseOptimizer` walks its update unit by unit and, with
`offload_state=True`, keeps each rank's fp32 masters and optimizer state in host memory.

[Note: optimizer-state offload]
Between steps the separate fp32 masters (`OwnedPiece.separate_master`: the param view itself
stays with the param) and every state tensor of at least one dimension (Muon's momentum, Adam's
moments, NorMuon's and SOAP's per-matrix tensors; not the 0-d `step` counters) live in host
memory, pinned on an accelerator. The step walks the storage units in reduce order; for each
unit with pieces to step:
1. its masters and state are copied to the device (on a side stream), the copy of the next
   unit's issued before this unit's update, so it overlaps this unit's update;
2. the update runs there, as it would without offload (the same tensors' values, the same ops);
3. masters and state are copied back into the host tensors (on the side stream), and the
   device copies are freed once those copies are done.
Cast fp32 master grads (`master.grad is not grad`) exist only while their unit steps.
At most three units' state is on the device at once (one landing, one stepping, one going
back). Nothing waits for the host in a step: a reader of the host values (`wait()`: state,
checkpoints) waits for the last copy back.

On the CPU the host is the device and nothing moves, unless `StateOffload.force_copies` is set
(the tests do): then every tensor goes through the same copies into separate tensors, so the
CPU tests run the path a GPU runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, NamedTuple

import torch

from .pieces import OwnedPiece

Update = Callable[[list[OwnedPiece], frozenset[str]], None]


class _Landing(NamedTuple):
    """One unit's pieces with device copies of what lives on the host: `moved` lists (piece,
    state key or None for the master, host tensor, device copy); `event`: the copies done."""

    pieces: list[OwnedPiece]
    moved: list[tuple[OwnedPiece, str | None, torch.Tensor, torch.Tensor]]
    event: torch.Event | None


def offloaded(value: Any) -> bool:
    """Whether a state value lives on the host between steps: a tensor of at least one dim."""
    return torch.is_tensor(value) and value.ndim > 0


class StateOffload:
    """The unit walk of one `LayerwiseOptimizer` ([Note: optimizer-state offload]).

    Args:
        inner: the torch optimizers by piece kind, whose `state` is keyed by `piece.stepped`.
        by_unit: each unit's owned pieces.
        device: where the params live.
        enabled: keep masters and state on the host (a no-op on the CPU unless `force_copies`).
        tensor_parallel: some params are DTensors (refused with `enabled`, on every rank alike).
    """

    force_copies: ClassVar[bool] = False
    """On the CPU, copy as on an accelerator (into separate tensors): for the tests."""

    def __init__(
        self,
        inner: Mapping[str, torch.optim.Optimizer],
        by_unit: Mapping[int, list[OwnedPiece]],
        device: torch.device,
        enabled: bool,
        tensor_parallel: bool = False,
    ) -> None:
        if enabled and tensor_parallel:
            raise NotImplementedError(
                "offload_state=True does not support tensor-parallel (DTensor) params yet: "
                "pass offload_state=False, or train without tensor parallelism"
            )
        self._inner = inner
        self._by_unit = by_unit
        self.device = device
        self.copies = enabled and (device.type != "cpu" or StateOffload.force_copies)
        self._pinned = device.type != "cpu"
        self._stream = torch.Stream(device=device) if self.copies and self._pinned else None
        self._back: torch.Event | None = None  # the last copy back to the host
        self._cast: set[int] = set()  # id of each piece whose master grad is a cast copy
        if self.copies:
            for piece in (p for ps in by_unit.values() for p in ps):
                if piece.master.grad is not piece.grad:
                    self._cast.add(id(piece))
                if piece.separate_master or id(piece) in self._cast:
                    piece.master.grad = None
                if piece.separate_master:
                    piece.master.data = self._host(piece.master.data)
            self.settle()

    # -- the walk ---------------------------------------------------------------------------

    def walk(self, units: Iterable[int], stepped: frozenset[str], update: Update) -> None:
        """`update(pieces, stepped)` for the owned pieces of each unit `units` yields, in that
        order; offloaded, the masters and state of those in `stepped` on the device, the next
        unit in unit order prefetched (the others' masters stay on the host: `update` writes
        their params from there)."""
        if not self.copies:
            for unit in units:
                update(self._by_unit.get(unit, []), stepped)
            return
        todo = {u: [o for o in ps if o.name in stepped] for u, ps in self._by_unit.items()}
        order = sorted(u for u, ps in todo.items() if ps)
        following = dict(zip(order, order[1:], strict=False))
        landed: dict[int, _Landing] = {}
        for unit in units:
            pieces = todo.get(unit)
            if not pieces:  # nothing steps: the params are written from the host masters
                update(self._by_unit.get(unit, []), stepped)
                continue
            here = landed.pop(unit, None) or self._fetch(pieces)
            after = following.get(unit)
            if after is not None and after not in landed:
                landed[after] = self._fetch(todo[after])  # overlaps this unit's update
            self._swap_in(here)
            try:
                update(self._by_unit[unit], stepped)
            finally:
                self._swap_out(here)

    def _fetch(self, pieces: list[OwnedPiece]) -> _Landing:
        """Start copying `pieces`' masters and state to the device."""
        moved = []
        for piece in pieces:
            if piece.separate_master:
                moved.append((piece, None, piece.master.data))
            state = self._state(piece)
            moved += [(piece, k, v) for k, v in state.items() if offloaded(v)]
        # Allocated on the compute stream; the side stream writes them once it is past what
        # that stream queued before (a freed block may be reused), and holds them until done.
        copies = [torch.empty_like(host, device=self.device) for *_, host in moved]
        with self._on_side():
            for copy, (*_, host) in zip(copies, moved, strict=True):
                copy.copy_(host, non_blocking=True)
                if self._stream is not None:
                    copy.record_stream(self._stream)
        event = self._stream.record_event() if self._stream is not None else None
        return _Landing(pieces, [(*m, c) for m, c in zip(moved, copies, strict=True)], event)

    def _swap_in(self, landing: _Landing) -> None:
        """Make the device copies live (after they land): masters, their grads, the state."""
        if landing.event is not None:
            torch.accelerator.current_stream(self.device).wait_event(landing.event)
        for piece, key, _, copy in landing.moved:
            if key is None:
                piece.master.data = copy
            else:
                self._state(piece)[key] = copy
        for piece in landing.pieces:
            if id(piece) in self._cast:
                piece.master.grad = torch.empty_like(piece.master)
            elif piece.separate_master:
                piece.master.grad = piece.grad

    def _swap_out(self, landing: _Landing) -> None:
        """Copy the updated masters and state back into host tensors (the ones they came from
        where they fit) and make those live; the device copies go when the copies are done."""
        hosts = {(id(piece), key): host for piece, key, host, _ in landing.moved}
        with self._on_side():
            for piece in landing.pieces:
                if piece.separate_master or id(piece) in self._cast:
                    piece.master.grad = None
                if piece.separate_master:
                    piece.master.data = self._back_to(
                        piece.master.data, hosts.get((id(piece), None))
                    )
                state = self._state(piece)
                for key, value in state.items():
                    if offloaded(value):
                        state[key] = self._back_to(value, hosts.get((id(piece), key)))
        if self._stream is not None:
            self._back = self._stream.record_event()

    def _back_to(self, value: torch.Tensor, host: torch.Tensor | None) -> torch.Tensor:
        """`value` (on the device) copied into `host`, or a new host tensor where `host` does not
        fit it; on the side stream when there is one."""
        if host is None or not self._fits(host, value):
            host = self._host_like(value)
        host.copy_(value, non_blocking=True)
        if self._stream is not None:
            value.record_stream(self._stream)
        return host

    def _on_side(self) -> contextlib.AbstractContextManager:
        """The side stream, after what the compute stream queued so far (nothing on the CPU)."""
        if self._stream is None:
            return contextlib.nullcontext()
        self._stream.wait_stream(torch.accelerator.current_stream(self.device))
        return self._stream

    # -- host tensors -----------------------------------------------------------------------

    def wait(self) -> None:
        """Wait until the host tensors hold the last step's values (before reading them)."""
        if self._back is not None:
            self._back.synchronize()
            self._back = None

    def settle(self) -> None:
        """Move every offloaded tensor not yet in (pinned) host memory there: after loading."""
        if not self.copies:
            return
        self.wait()
        for piece in (p for ps in self._by_unit.values() for p in ps):
            state = self._state(piece)
            for key, value in state.items():
                if offloaded(value) and not self._is_host(value):
                    state[key] = self._host(value)

    def host_bytes(self) -> int:
        """Bytes of masters and state held in host memory (0 unless copying)."""
        if not self.copies:
            return 0
        total = 0
        for piece in (p for ps in self._by_unit.values() for p in ps):
            total += piece.master.nbytes if piece.separate_master else 0
            total += sum(v.nbytes for v in self._state(piece).values() if offloaded(v))
        return total

    def _state(self, piece: OwnedPiece) -> dict[str, Any]:
        """The live state of `piece` (an empty dict, not added, before its first step)."""
        return self._inner[piece.kind].state.get(piece.stepped, {})

    def _is_host(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and (not self._pinned or t.is_pinned())

    def _fits(self, host: torch.Tensor, value: torch.Tensor) -> bool:
        same = (host.dtype, host.shape, host.stride()) == (value.dtype, value.shape, value.stride())
        return same and self._is_host(host)

    def _host_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t, device="cpu", pin_memory=self._pinned)

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of `t` (pinned on an accelerator), made now."""
        host = self._host_like(t)
        host.copy_(t)
        return host

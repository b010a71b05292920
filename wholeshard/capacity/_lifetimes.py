"""Fully sharded lifetimes from names alone: which storage units stay gathered from forward to
backward, and the most bytes of full units alive at once in a step.

[Note: the module model]
A plan has no modules, so they are read from param names, as `named_parameters()` lists them:
a param belongs to the module its name names (`blocks.0.fc.weight` to `blocks.0.fc`, a name
without a dot to the root), modules run forward once each in the registration order of their
first param, a module's span holding its descendants', and backward in reverse: a module's
output gradient arrives (its pre-backward hook) where its forward ended, its params' gradients
land, last-registered first, where its forward began. Every non-root module's outputs can be
hooked. A model whose modules run in another order (Llama's norms run before the projections
registered ahead of them), call a module twice, recompute activations, or hold params in a
container (`ParameterList`) lives through other lifetimes; a tied param's second module (a tied
head) is not in the plan at all.

On that model `peak_bytes` replays the engine's scheduler (`wholeshard/engine/_schedule.py`:
[Note: fully sharded lifetimes], the dispatch queue of [Note: collective order], one reduction
in flight) over the units' full param and grad buffers and the gradients kept until a unit's
full grads get storage ([Note: kept gradients] in the engine's `_kept_grads`: where the param
dtype is the smaller), counting bytes after each allocation and each gradient kept.
On an exchange plan it also replays the exchanges to the owners (a batch leaves before the
reduction after its last unit starts, or at the step), each giving the batch's owned copies
that live only through the step (the grads', and the params' where the masters are separate)
storage until the step ends ([Note: owned copies] in the engine's `_owned_copies`);
those differ from rank to rank, so the replay keeps the most full bytes alive while each number
of batches is exchanged, and a rank's peak adds its copies of those batches.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from collections.abc import Sequence

from ..planning.specs import ParamSpec
from ..planning.units import Unit


def module_of(name: str) -> str:
    """The module holding param `name` ([Note: the module model]): "" for the root."""
    return name.rpartition(".")[0]


def kept_units(units: Sequence[Unit]) -> set[int]:
    """Units kept gathered from forward to backward: the first in reduce order, and those
    holding root params (the root's output gradient cannot announce its backward)."""
    return {0} | {u.index for u in units if any(module_of(n) == "" for n in u.names)}


def _events(specs: Sequence[ParamSpec]) -> list[tuple[str, str]]:
    """("pre" | "post", module) of every forward, root first and last, nested by names."""
    order = list(dict.fromkeys(module_of(s.name) for s in specs))
    events, stack = [], []
    if "" in order:
        order.remove("")
        events.append(("pre", ""))
    for m in order:
        while stack and not m.startswith(stack[-1] + "."):
            events.append(("post", stack.pop()))
        events.append(("pre", m))
        stack.append(m)
    events += [("post", m) for m in reversed(stack)]
    if events and events[0] == ("pre", ""):
        events.append(("post", ""))
    return events


class _Replay:
    """The engine's fully sharded scheduler over units, tracking allocations only."""

    def __init__(self, units: Sequence[Unit], specs: Sequence[ParamSpec], param_bytes: int,
                 grad_bytes: int, overlap_grad: bool, overlap_param: bool,
                 batches: Sequence[Sequence[int]]) -> None:  # fmt: skip
        n = len(units)
        self.batches = batches  # the exchange batches' units, in order (none: no exchange)
        self.full = [(u.numel * param_bytes, u.numel * grad_bytes) for u in units]
        # each param's gradient as autograd makes it (param dtype), kept until its unit's full
        # grads get storage where it is the smaller ([Note: kept gradients])
        self.kept_grad = {s.name: math.prod(s.shape) * param_bytes for s in specs}
        self.keeps = param_bytes < grad_bytes
        self.kept_bytes = [0] * n
        self.unit_of = {name: u.index for u in units for name in u.names}
        self.size = [len(u.names) for u in units]
        registered = {s.name: i for i, s in enumerate(specs)}
        first = [min(registered[name] for name in u.names) for u in units]
        self.forward_order = sorted(range(n), key=first.__getitem__)
        self.params_of: dict[str, list[str]] = {}
        for s in specs:
            self.params_of.setdefault(module_of(s.name), []).append(s.name)
        self.units_of = {
            m: sorted({self.unit_of[name] for name in names}) for m, names in self.params_of.items()
        }
        modules_using = Counter(i for used in self.units_of.values() for i in used)
        self.users = [modules_using[i] for i in range(n)]
        self.overlap_grad, self.overlap_param = overlap_grad, overlap_param
        self.state = ["released"] * n  # "released", "gathering" or "fresh"
        self.param_alive = [False] * n
        self.grad_alive = [False] * n
        self.reducing = [False] * n
        self.n_final = [0] * n
        self.forward_left = [0] * n
        self.kept = {0}  # units kept gathered from forward to backward (`kept_units`)
        self.queue: deque[int] = deque()
        self.queued: set[int] = set()
        self.gathering = 0
        self.next_reduce = 0
        self.in_backward = False
        self.alive = 0
        self.exchanged = 0  # batches whose owned copies have storage
        self.peaks = [0] * (len(batches) + 1)  # most full bytes alive, by `exchanged`

    def _alloc(self, i: int, grad: bool) -> None:
        """Materialise unit i's full params (or grads) and count the bytes now alive."""
        (self.grad_alive if grad else self.param_alive)[i] = True
        self.alive += self.full[i][grad]
        self._count()

    def _count(self) -> None:
        self.peaks[self.exchanged] = max(self.peaks[self.exchanged], self.alive)

    def _free(self, i: int, grad: bool) -> None:
        alive = self.grad_alive if grad else self.param_alive
        if alive[i]:
            alive[i] = False
            self.alive -= self.full[i][grad]

    def _materialise_grads(self, i: int) -> None:
        """Give unit i's full grads storage, adding in (and dropping) the gradients kept."""
        if not self.grad_alive[i]:
            self._alloc(i, grad=True)
        self.alive -= self.kept_bytes[i]
        self.kept_bytes[i] = 0

    # -- gathers ------------------------------------------------------------------------------

    def start_gather(self, i: int) -> None:
        if not self.param_alive[i]:
            self._alloc(i, grad=False)
        self.state[i] = "gathering"
        self.gathering += 1

    def finish_gather(self, i: int) -> None:
        self.state[i] = "fresh"
        self.gathering -= 1
        self.forward_left[i] = self.users[i]

    def release(self, i: int) -> None:
        if self.state[i] == "gathering":
            self.finish_gather(i)
        self._free(i, grad=False)
        self.state[i] = "released"

    def set_queue(self, order: Sequence[int]) -> None:
        self.queue = deque(i for i in order if self.state[i] not in ("fresh", "gathering"))
        self.queued = set(self.queue)

    def dispatch_next(self) -> None:
        if self.queue:
            i = self.queue.popleft()
            self.queued.discard(i)
            self.start_gather(i)

    def finish_param_sync(self) -> None:
        while self.queue:
            self.dispatch_next()
        for i, state in enumerate(self.state):
            if state == "gathering":
                self.finish_gather(i)

    def ensure(self, units: Sequence[int]) -> None:
        for i in units:
            if self.state[i] == "fresh":
                continue
            if self.state[i] != "gathering":
                if i in self.queued:
                    while self.state[i] != "gathering":
                        self.dispatch_next()
                else:
                    self.start_gather(i)
            self.finish_gather(i)
        if self.overlap_param and not self.gathering:
            self.dispatch_next()

    # -- forward ------------------------------------------------------------------------------

    def root_pre_forward(self) -> None:
        self.finish_param_sync()
        self.forward_left = list(self.users)
        self.set_queue(self.forward_order)
        if self.overlap_param:
            self.dispatch_next()

    def pre_forward(self, module: str) -> None:
        units = self.units_of[module]
        if self.queue or any(self.state[i] != "fresh" for i in units):
            self.ensure(units)

    def post_forward(self, module: str) -> None:
        for i in self.units_of[module]:
            self.forward_left[i] -= 1
            if module == "":  # the root's outputs announce no backward
                self.kept.add(i)
            if self.forward_left[i] <= 0 and i not in self.kept and self.param_alive[i]:
                self.release(i)

    def root_post_forward(self) -> None:
        self.finish_param_sync()
        for i in range(len(self.full)):
            if self.param_alive[i] and i not in self.kept:
                self.release(i)

    # -- backward -----------------------------------------------------------------------------

    def enter_backward(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            self.finish_param_sync()
            self.set_queue(range(len(self.full)))

    def pre_backward(self, module: str) -> None:
        self.enter_backward()
        self.ensure(self.units_of[module])

    def receive_grad(self, name: str) -> None:
        i = self.unit_of[name]
        self.enter_backward()
        if self.keeps and not self.grad_alive[i]:
            self.kept_bytes[i] += self.kept_grad[name]
            self.alive += self.kept_grad[name]
            self._count()
        else:
            self._materialise_grads(i)
        self.n_final[i] += 1
        if self.n_final[i] < self.size[i]:
            return
        self.release(i)
        if self.overlap_grad:
            self.start_reduces()

    def start_reduces(self, every: bool = False) -> None:
        """Reduce, in order, each unit from the next on whose grads are all final (`every`:
        all of them, as the step does)."""
        while (n := self.next_reduce) < len(self.full) and (
            every or self.n_final[n] == self.size[n]
        ):
            if n >= 1:
                self.finish_reduce(n - 1)  # one reduction in flight (REDUCES_IN_FLIGHT)
                self.exchange_through(n - 1)
            self._materialise_grads(n)
            self.reducing[n] = True
            self.next_reduce += 1

    def finish_reduce(self, i: int) -> None:
        if self.reducing[i]:
            self.reducing[i] = False
            self._free(i, grad=True)

    def exchange_through(self, last: int) -> None:
        """Exchange each batch not yet exchanged whose units are all among 0..`last`, once its
        units' reductions finished."""
        while self.exchanged < len(self.batches) and self.batches[self.exchanged][-1] <= last:
            for i in self.batches[self.exchanged]:
                self.finish_reduce(i)
            self.exchanged += 1
            self._count()

    def step(self) -> None:
        """The step's reductions and exchanges (`Scheduler.finish_grad_sync`)."""
        self.start_reduces(every=True)
        self.exchange_through(len(self.full) - 1)
        for i in range(len(self.full)):
            self.finish_reduce(i)

    def backward_done(self) -> None:
        self.in_backward = False
        self.finish_param_sync()
        self.kept = {0}
        for i in range(len(self.full)):
            if self.param_alive[i]:
                self.release(i)


def peak_bytes(
    units: Sequence[Unit],
    specs: Sequence[ParamSpec],
    param_bytes: int,
    grad_bytes: int,
    overlap_grad_reduce: bool,
    overlap_param_gather: bool,
    batches: Sequence[Sequence[int]] = (),
    copies: Sequence[Sequence[int]] = ((),),
) -> tuple[int, ...]:
    """Per rank, the most bytes of full units (params and grads, `param_bytes` and `grad_bytes`
    per element) and step-only owned copies alive at once through one fully sharded training
    step, on [Note: the module model], with `costs.Mode`'s two overlap options. `batches`: the
    units of each exchange batch, in order; `copies[r][j]`: rank r's bytes of the owned copies
    of batch j that live only through the step (one rank and no exchange by default)."""
    replay = _Replay(units, specs, param_bytes, grad_bytes, overlap_grad_reduce,
                     overlap_param_gather, batches)  # fmt: skip
    events = _events(specs)
    replay.root_pre_forward()
    for kind, module in events:
        if module in replay.units_of:
            (replay.pre_forward if kind == "pre" else replay.post_forward)(module)
    replay.root_post_forward()
    for kind, module in reversed(events):
        if module not in replay.units_of:
            continue
        if kind == "post" and module != "":
            replay.pre_backward(module)
        elif kind == "pre":
            for name in reversed(replay.params_of[module]):
                replay.receive_grad(name)
    replay.backward_done()
    replay.step()
    out = []
    for mine in copies:
        held = itertools.accumulate(mine, initial=0)
        out.append(max(full + n for full, n in zip(replay.peaks, held, strict=True)))
    return tuple(out)

"""Shared test pieces: a small transformer, data, the single-process reference, a runner.

The reference: one process, the full global batch, torch.optim.Muon on the
matrix-routed params and torch.optim.AdamW on the rest (fp32 masters when params are bf16).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
from collections.abc import Callable, Collection, Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import wholeshard
import wholeshard.bench.baselines  # noqa: F401  (registers the legacy baselines' layouts)
from wholeshard.distributed.launch import launch
from wholeshard.engine.config import Variant
from wholeshard.planning import Buffer, ParamSpec, validate_specs
from wholeshard.planning.plan import _group_size, plan_buffer
from wholeshard.planning.routing import Route, route_params

VOCAB, DIM, SEQ, GLOBAL_BATCH = 64, 32, 8, 12  # 12 splits evenly over 1, 2, 3 and 4 ranks
MUON_KW = dict(lr=0.02, weight_decay=0.01, momentum=0.9, adjust_lr_fn="match_rms_adamw")
ADAMW_KW = dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.01)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def grid(
    *axes: dict[str, Any], core: str | Collection[str] = (), slow: Collection[str] = ()
) -> list[Any]:
    """The cases of stacked `parametrize` decorators as one list, so that single cases can carry
    a mark: each axis maps ids to values; a case's id joins its values' ids with "-" (as stacked
    decorators do, the first axis first); the cases named in `core` carry the `core` mark (the
    fast tier, `pytest -m core`), those in `slow` the `slow` mark."""
    marked = [
        (pytest.mark.core, {core} if isinstance(core, str) else set(core)),
        (pytest.mark.slow, set(slow)),
    ]
    cases = []
    for combo in itertools.product(*(axis.items() for axis in axes)):
        case_id = "-".join(str(i) for i, _ in combo)
        marks = [mark for mark, ids in marked if case_id in ids]
        cases.append(pytest.param(*(v for _, v in combo), id=case_id, marks=marks))
    unknown = set().union(*(ids for _, ids in marked)) - {case.id for case in cases}
    assert not unknown, f"no such case: {sorted(unknown)}"
    return cases


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # a key bias has no gradient: pure noise
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a)
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    """Embedding, position embedding, two blocks, final norm, head (tied or not)."""

    def __init__(self, tied: bool = False, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(layers))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def make_model(seed: int = 0, **kw: Any) -> nn.Module:
    torch.manual_seed(seed)
    return TinyLM(**kw)


def fp8_model(recipe: str) -> Callable[[], nn.Module]:
    """Makes `make_model()` with its matrix-routed linears converted to FP8 `recipe`."""

    def make() -> nn.Module:
        from wholeshard import fp8

        return fp8.convert(make_model(), recipe)

    return make


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: inputs and next-token targets, same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def local_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step)
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of `model` on `(x, y)`, moved to the model's device."""
    x, y = x.to(device_of(model)), y.to(device_of(model))
    out = model(x)
    logits = getattr(out, "logits", out)  # a transformers model returns an output object
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every param as fp32 on the CPU (comparable across devices and processes)."""
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def matrices_of(route: Route, t: torch.Tensor) -> list[torch.Tensor]:
    """`t` (shaped like the route's param) as the fp32 tensors the reference steps: one (out, in)
    matrix per matrix of a Muon stack, the transpose of a weight stored (in, out), else `t`."""
    t = t.detach().float()
    if route.matrix and t.ndim > 2:
        return [m.clone() for m in t.reshape(-1, *t.shape[-2:]).unbind()]
    if route.matrix and route.transposed:
        return [t.T.contiguous()]
    return [t.clone()]


def from_matrices(route: Route, masters: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of `matrices_of`: the param's values in its own shape."""
    if len(masters) > 1 or route.param.ndim > 2:
        return torch.stack(masters).view(route.param.shape)
    return masters[0].T if route.matrix and route.transposed else masters[0]


_REFERENCES: dict[Any, dict[str, Any]] = {}


def _frozen(value: Any) -> Any:
    """`value` as a hashable key (dicts and lists as tuples); TypeError if it holds a tensor or
    anything else unhashable or compared by value in another way."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, torch.Tensor):
        raise TypeError("a tensor is no key")
    hash(value)
    return value


def reference_run(steps: int, **kw: Any) -> dict[str, Any]:
    """`_reference_run(steps, **kw)`, computed once per test process for each distinct call (it
    is deterministic: every model is seeded) and handed out as a deep copy. A call given tensors
    (`state`) runs anew."""
    try:
        key = (steps, _frozen(kw))
    except TypeError:
        return _reference_run(steps, **kw)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference_run(steps, **kw)
    return copy.deepcopy(_REFERENCES[key])


def _reference_run(
    steps: int,
    *,
    param_dtype: torch.dtype = torch.float32,
    clip: float | None = None,
    model_kw: dict | None = None,
    muon_kw: dict | None = None,
    adamw_kw: dict | None = None,
    matrix_params: Callable | None = None,
    unused_param: bool = False,
    make: Callable[[], nn.Module] | None = None,
    probe: Callable[[nn.Module], Any] | None = None,
    start: int = 0,
    state: dict[str, dict[str, torch.Tensor]] | None = None,
    device: str = "cpu",
    loss_of: Callable[[nn.Module, int], torch.Tensor] | None = None,
    world: int | None = None,
) -> dict[str, Any]:
    """Train on the full batch in one process with torch's own optimizers, each Muon matrix
    (every matrix of a stack, a transposed weight as (out, in)) a param of its own.
    `loss_of(model, step)` is a step's loss instead of `lm_loss` on its full batch; `world`:
    on the sequences `world` ranks train on, each an equal slice of every batch (at 8 ranks,
    8 of the 12).
    `make()` builds the model instead of `make_model(**model_kw)`; `probe(model)` runs on the
    trained model and its result is returned as "probe" (e.g. generated tokens). `start` is the
    first step's batch; `state` (by param name: full fp32 "value" and optimizer state, as in
    the param's shape) replaces the initial params and the optimizers' empty state. `device`:
    where it trains ("cpu" or "cuda")."""
    model = make() if make is not None else make_model(**(model_kw or {}))
    if unused_param:
        model.unused = nn.Linear(DIM, DIM)
    model.to(device=device, dtype=param_dtype)
    routes = route_params(model, matrix_params)
    if state is not None:
        with torch.no_grad():
            for r in routes:
                r.param.copy_(state[r.name]["value"])
    masters = {r.name: matrices_of(r, r.param) for r in routes}
    opts = [
        torch.optim.Muon(
            [m for r in routes if r.matrix for m in masters[r.name]], **(muon_kw or MUON_KW)
        ),
        torch.optim.AdamW(
            [m for r in routes if not r.matrix for m in masters[r.name]], **(adamw_kw or ADAMW_KW)
        ),
    ]
    if state is not None:
        for r in routes:
            saved = {k: matrices_of(r, v) for k, v in state[r.name].items() if k != "value"}
            for i, m in enumerate(masters[r.name]):
                opts[0 if r.matrix else 1].state[m] = {k: v[i] for k, v in saved.items()}
    losses, norms = [], []
    used = GLOBAL_BATCH if world is None else GLOBAL_BATCH // world * world
    for step in range(start, start + steps):
        if loss_of is None:
            loss = lm_loss(model, *(t[:used] for t in batch(step)))
        else:
            loss = loss_of(model, step)
        loss.backward()
        for r in routes:  # a param without a gradient is not stepped (its masters' grads None)
            g = r.param.grad
            for i, m in enumerate(masters[r.name]):
                m.grad = None if g is None else matrices_of(r, g)[i]
            r.param.grad = None
        if clip is not None:
            every = [m for ms in masters.values() for m in ms]
            norms.append(torch.nn.utils.clip_grad_norm_(every, clip).item())
        for opt in opts:
            opt.step()
        with torch.no_grad():
            for r in routes:
                r.param.copy_(from_matrices(r, masters[r.name]))
        losses.append(loss.item())
    probed = probe(model) if probe is not None else None
    return {"params": full_params(model), "losses": losses, "norms": norms, "probe": probed}


def mp(param_dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32) -> MixedPrecisionPolicy:
    """The tests' mixed precision: compute in `param_dtype`, reduce gradients in float32 (the
    reference's precision) unless told."""
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


VARIANT_FIELDS = frozenset(f.name for f in dataclasses.fields(Variant))


def data_parallel(module: nn.Module, **kw: Any) -> wholeshard.DataParallel:
    """`wholeshard.DataParallel(module, **kw)`, where `kw` may also name `Variant` fields (the
    alternatives kept for comparison: layout, strategy, exchange_every,
    separate_all_gather_group; the legacy baselines are layouts of `wholeshard.bench.baselines`:
    "ping_pong", "ping_pong_broadcasts", "shard_broadcasts")."""
    variant = {k: kw.pop(k) for k in [k for k in kw if k in VARIANT_FIELDS]}
    return wholeshard.DataParallel(module, _variant=Variant(**variant), **kw)


def wholeshard_run(
    steps: int,
    *,
    param_dtype: torch.dtype = torch.float32,
    clip: float | None = None,
    model_kw: dict | None = None,
    ddp_kw: dict | None = None,
    muon_kw: dict | None = None,
    adamw_kw: dict | None = None,
    matrix_params: Callable | None = None,
    unused_param: bool = False,
    micro_batches: int = 1,
    evaluate: bool = False,
    make: Callable[[], nn.Module] | None = None,
    probe: Callable[[nn.Module], Any] | None = None,
    keep_ddp: bool = False,
    keep_opt: bool = False,
    lr_lambda: Callable[[int], float] | None = None,
    device: str = "cpu",
    matrix_optimizer: type[torch.optim.Optimizer] = torch.optim.Muon,
    opt_kw: dict | None = None,
) -> dict[str, Any]:
    """The same training on this rank's slice of every batch; returns what the tests compare.

    `micro_batches > 1` accumulates gradients under `ddp.no_sync()`; `evaluate` runs a no-grad
    forward on a fixed batch after every step; `make()` builds the model as in `reference_run`;
    `probe(model)` runs on the wrapped module right after the last step (overlapped gathers
    still in flight) and its result is returned as "probe"; `keep_ddp` adds the wrapper as
    "ddp" and `keep_opt` its optimizer as "opt" (for inspection inside the worker: they do not
    pickle); `lr_lambda` drives a `LambdaLR` scheduler stepped after every optimizer step;
    `device`: where the model runs (outputs come back on the CPU); `matrix_optimizer` steps the
    matrix-routed matrices with `muon_kw`; `opt_kw`: more `LayerwiseOptimizer` arguments.
    """
    rank, world = rank_world()
    model = make() if make is not None else make_model(**(model_kw or {}))
    if unused_param:
        model.unused = nn.Linear(DIM, DIM)
    model.to(device)
    ddp = data_parallel(
        model, mp_policy=mp(param_dtype), matrix_params=matrix_params, **(ddp_kw or {})
    )
    opt = wholeshard.LayerwiseOptimizer(
        ddp,
        matrix=muon_kw or MUON_KW,
        adamw=adamw_kw or ADAMW_KW,
        matrix_optimizer=matrix_optimizer,
        **(opt_kw or {}),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    losses, norms, evals = [], [], []
    for step in range(steps):
        x, y = local_batch(step, rank, world)
        total = torch.zeros((), device=device)
        for i, (xm, ym) in enumerate(
            zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches), strict=True)
        ):
            last = i == micro_batches - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = lm_loss(ddp, xm, ym) * (len(xm) / len(x))
                loss.backward()
            total += loss.detach()
        if clip is not None:
            norms.append(opt.clip_grad_norm_(clip).item())
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(_global_mean(total))
        if evaluate:
            with torch.no_grad():
                evals.append(lm_loss(ddp, *batch(99)).item())
    probed = probe(model) if probe is not None else None
    with ddp.full_params():
        params = full_params(model)
    state = {
        name: {k: v.cpu().clone() for k, v in entry.items() if torch.is_tensor(v)}
        for name, entry in opt.state_dict()["state"].items()
    }
    out = {
        "params": params,
        "losses": losses,
        "norms": norms,
        "evals": evals,
        "opt_state": state,
        "comm_wait_s": ddp.comm_wait_s,
        "probe": probed,
    }
    return out | ({"ddp": ddp} if keep_ddp else {}) | ({"opt": opt} if keep_opt else {})


def train_part(
    path: str, steps: range, load: bool, make: Callable[[], nn.Module], **ddp_kw: Any
) -> dict[str, Any]:
    """Train `make()` wrapped with `ddp_kw` (`data_parallel`) over `steps`, loading the
    checkpoint at `path` first if `load`, else saving one there after; returns the full params
    and the plan's first buffer kind."""
    rank, world = rank_world()
    model = make()
    ddp = data_parallel(model, **ddp_kw)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
    if load:
        wholeshard.load_checkpoint(path, ddp, opt)
    for step in steps:
        lm_loss(ddp, *local_batch(step, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    if not load:
        wholeshard.save_checkpoint(path, ddp, opt, extra={"step": steps.stop})
    with ddp.full_params():
        return {"params": full_params(model), "kind": ddp.plan.buffers[0].kind}


OVERLAP = dict(overlap_grad_reduce=True, overlap_param_gather=True)
SYNC = dict(overlap_grad_reduce=False)
"""Every collective at the step (the default reduces during backward)."""
MAIN_MODES = {
    "sync": SYNC,
    "overlap": OVERLAP,
    "fully-sharded": dict(reshard_after_forward=True, **OVERLAP),
    "pipelined": dict(pipelined_step=True, **OVERLAP),
    "shard-groups": dict(shard_group_size=1),
}
"""The main `DataParallel` modes by name, for tests that run every one of them."""


def assert_overlap_equals_sync(nproc: int, steps: int, ddp_kw: dict, **kw: Any) -> list[dict]:
    """Train synchronously and overlapped on `nproc` ranks; assert every rank's results are
    bitwise equal; return the synchronous run's per-rank results."""
    sync = run(wholeshard_run, nproc, steps, ddp_kw=dict(ddp_kw, **SYNC), **kw)
    overlap = run(wholeshard_run, nproc, steps, ddp_kw=dict(ddp_kw, **OVERLAP), **kw)
    for a, b in zip(sync, overlap, strict=True):
        assert_bitwise_equal(a, b)
    return sync


def _global_mean(x: torch.Tensor) -> float:
    if dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
    return x.item()


def rank_world() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 without a process group)."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def local_loss(model: nn.Module, step: int = 0) -> torch.Tensor:
    """`lm_loss` of `model` on this rank's slice of `step`'s batch."""
    return lm_loss(model, *local_batch(step, *rank_world()))


def wrapped(
    model: nn.Module | None = None, **ddp_kw: Any
) -> tuple[wholeshard.DataParallel, wholeshard.LayerwiseOptimizer]:
    """`data_parallel(model, **ddp_kw)` (`model` by default `make_model()`) and a
    `LayerwiseOptimizer` over it with `MUON_KW` and `ADAMW_KW`."""
    ddp = data_parallel(make_model() if model is None else model, **ddp_kw)
    return ddp, wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)


def train_steps(
    ddp: nn.Module, opt: torch.optim.Optimizer, steps: Iterable[int]
) -> list[torch.Tensor]:
    """One optimizer step per step of `steps` on this rank's slice of its batch; returns this
    rank's losses (detached tensors)."""
    losses = []
    for step in steps:
        loss = local_loss(ddp, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def run(fn: Callable[..., Any], nproc: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `nproc` forked gloo ranks (inline, no group, for nproc=0)."""
    if nproc == 0:
        return [fn(*args, **kwargs)]
    return launch(functools.partial(fn, *args, **kwargs), nproc, start_method="fork", timeout=120)


DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
DETAIL_TIMEOUT_S = 30.0
"""How long a collective under `DETAIL` waits for a peer to issue the same one before it raises
(the suite's collectives are milliseconds apart; a loaded machine stretches that to seconds)."""


def run_detail(fn: Callable[..., Any], nproc: int, *args: Any, **kwargs: Any) -> list[Any]:
    """`run` under `TORCH_DISTRIBUTED_DEBUG=DETAIL`: before each collective every rank checks
    that its peers issue the same one (op, sizes, dtypes) and blocks until they do, as NCCL
    would, so ranks that issue collectives in another order, even across groups (which gloo
    forgives), fail after `DETAIL_TIMEOUT_S` instead of passing."""
    return launch(
        functools.partial(fn, *args, **kwargs),
        nproc,
        start_method="fork",
        timeout=120,
        collective_timeout_s=DETAIL_TIMEOUT_S,
        env=DETAIL,
    )


def run_cuda(
    fn: Callable[..., Any], nproc: int, *args: Any, backend: str = "gloo", **kwargs: Any
) -> list[Any]:
    """`run` on the GPU: `nproc` spawned ranks, each on GPU `rank % device_count` (gloo lets
    several share one; NCCL needs one each)."""
    return launch(
        functools.partial(fn, *args, **kwargs),
        nproc,
        start_method="spawn",
        timeout=600,
        backend=backend,
        device="cuda",
    )


def cuda_deterministic() -> None:
    """[Note: deterministic GPU runs]
    On CUDA two runs of the same program can differ in the last bits: cuBLAS picks workspace-
    dependent kernels, flash and memory-efficient attention backward and some scatter backwards
    use atomics, and NCCL's sum order follows its algorithm and protocol. The GPU tier's bitwise
    claims (overlap == sync, fully sharded == ZeRO, resume == uninterrupted) hold under
    deterministic algorithms, a fixed cuBLAS workspace, math attention and a fixed NCCL ring,
    which this sets for the calling process (its spawned workers inherit the environment)."""
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    os.environ.setdefault("NCCL_PROTO", "Simple")
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# Only the summation order of the gradient average differs from the reference. bf16
# Newton-Schulz amplifies that to ~1e-3 per element after 5 steps (measured max 1.3e-3, RMS 2.8e-4),
# a quarter of one Muon step (lr 0.02 * 0.2 * sqrt(128) * rms(O) ~ 4e-3 per element). bf16 params
# also flip by an ulp where the fp32 masters differ by a hair, and AdamW turns sign flips of
# near-zero bf16 gradients into +-lr (measured max 2.7e-2, RMS <= 3.5e-3).
TOL = {
    torch.float32: dict(atol=3e-3, rtol=0.0, rms=1e-3, loss_rtol=1e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=2**-5, rms=5e-3, loss_rtol=3e-3),
}


def assert_matches(out: dict, ref: dict, dtype: torch.dtype = torch.float32) -> None:
    """`out` is within the tolerance of the reference (see TOL)."""
    tol = TOL[dtype]
    for name, want in ref["params"].items():
        got = out["params"][name]
        diff = got - want
        assert torch.allclose(got, want, atol=tol["atol"], rtol=tol["rtol"]), (
            f"{name}: max diff {diff.abs().max().item():.3g}"
        )
        assert diff.pow(2).mean().sqrt() <= tol["rms"], f"{name}: rms diff {diff.pow(2).mean()}"
    assert out["losses"] == pytest.approx(ref["losses"], rel=tol["loss_rtol"])


def assert_same_params(outs: list[dict]) -> None:
    """Every rank's result holds the first rank's params, bit for bit."""
    for out in outs[1:]:
        for k, v in out["params"].items():
            assert torch.equal(v, outs[0]["params"][k]), k


def assert_bitwise_equal(a: dict, b: dict) -> None:
    """Params, optimizer state and losses identical to the bit."""
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert a["opt_state"].keys() == b["opt_state"].keys()
    for name in a["opt_state"]:
        for k, v in a["opt_state"][name].items():
            assert torch.equal(v, b["opt_state"][name][k]), (name, k)
    assert a["losses"] == b["losses"]


PINNED_NEWTON_SCHULZ = ("--newton-schulz", "torch_bf16")
"""What the tests' train jobs run Muon with: one implementation on every CPU kind (`auto` runs
`batched_fp32` on a CPU without bf16 matmul units, torch's Muon on the others)."""


def train_config(**flags: Any) -> Any:
    """The `TrainConfig` of `wholeshard train` given these flags (`batch_size=4` is
    `--batch-size 4`; True/False are `--x`/`--no-x`, None leaves a flag out), made by the CLI's
    own parser."""
    from wholeshard.cli import build_parser
    from wholeshard.cli.train import config_from_args

    if flags.get("matrix_optimizer", "muon") == "muon":  # runs compared bit for bit take one
        flags.setdefault("newton_schulz", PINNED_NEWTON_SCHULZ[1])  # implementation, not auto's
    argv = ["train"]
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append(flag.replace("--", "--no-", 1))
        elif value is not None:
            argv += [flag, str(value)]
    return config_from_args(build_parser().parse_args(argv))


# -- bench report inputs ---------------------------------------------------------------------


def bench_rank(**figures: Any) -> dict[str, Any]:
    """One rank's figures as a bench worker returns them (what `report.from_ranks` combines),
    with `figures` replacing the defaults; no launch counts."""
    from wholeshard.bench import launches

    seconds = dict(step_s=1.0, optimizer_s=0.5, comm_wait_s=0.1, torch_muon_owned_s=0.4)
    floors = dict(floor_forward_backward_s=0.2, floor_optimizer_s=0.3)
    sent = dict(bytes_sent_per_rank=8, gather_bytes_per_rank=2)
    memory = dict(peak_rss_bytes=300, peak_rss_delta_bytes=30, optimizer_state_bytes=4)
    unknown = dict.fromkeys(("persistent_bytes", "max_memory_allocated_bytes", *launches.FIELDS))
    rest = dict(final_loss=0.5, ns_flops_per_step=100)
    return seconds | floors | sent | memory | unknown | rest | figures


def bench_machine(**info: Any) -> dict[str, Any]:
    """What the bench's `machine()` reports, as `report.footer` reads it: one thread a rank on a
    2-core "cpu", torch "2.x", load average 0.5 -> 0.7; `info` adds or replaces entries."""
    load = dict(load_average_start=[0.5], load_average_end=[0.7])
    return dict(threads_per_rank=1, cpu="cpu", cores=2, torch="2.x", **load) | info


# -- planning (shapes only) ------------------------------------------------------------------


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def spec(name: str, *shape: int, matrix: bool | None = None, tied: bool = False) -> ParamSpec:
    """A `ParamSpec`; matrix-routed iff 2-D unless `matrix` says otherwise."""
    return ParamSpec(name, shape, matrix=len(shape) == 2 if matrix is None else matrix, tied=tied)


def shape_lists(max_size: int) -> st.SearchStrategy[list[tuple[int, ...]]]:
    """1..`max_size` shapes: vectors of up to 300 elements and matrices of up to 40 x 40."""
    vector, matrix = st.tuples(st.integers(1, 300)), st.tuples(*[st.integers(1, 40)] * 2)
    return st.lists(st.one_of(vector, matrix), min_size=1, max_size=max_size)


@st.composite
def spec_lists(draw: st.DrawFn, max_params: int = 40, tied_one_in: int = 20) -> list[ParamSpec]:
    """1..`max_params` specs of 0-, 1- and 2-D shapes (Muon iff 2-D), about half of them drawn
    from a small pool so that exact-numel partners exist; each tied with chance 1/`tied_one_in`."""
    dim = st.integers(1, 300)
    pool = draw(st.lists(st.one_of(st.tuples(dim), st.tuples(dim, dim)), min_size=1, max_size=6))
    specs = []
    for i in range(draw(st.integers(1, max_params))):
        shape = draw(
            st.one_of(st.sampled_from(pool), st.tuples(dim), st.tuples(dim, dim), st.just(()))
        )
        tied = draw(st.integers(0, tied_one_in - 1)) == 0
        specs.append(ParamSpec(f"p{i}", shape, matrix=len(shape) == 2, tied=tied))
    return specs


def whole_buffer(
    specs: list[ParamSpec],
    dp: int,
    *,
    strategy: str = "size_match",
    bucket_size: int | None = None,
    align: int = 64,
) -> Buffer:
    """The whole-tensor planner by `strategy` (the machinery `plan_exactly` runs on 2-D Muon
    specs) on every spec, as one checked "matrix" buffer."""
    specs = tuple(specs)
    _group_size(dp, None, bucket_size, align, strategy)
    validate_specs(specs)
    buffer = plan_buffer("matrix", specs, dp, bucket_size, align, strategy)
    buffer.check(specs)
    return buffer


def verify_whole_buffer(buffer: Buffer, specs: list[ParamSpec]) -> None:
    """Re-check every invariant of a whole-tensor buffer (any strategy) without calling
    `Buffer.check`."""
    k, align = buffer.shard_group_size, buffer.align
    assert buffer.kind == "matrix" and buffer.whole
    # Buckets: numbered in order, contiguous from 0; k equal aligned shards, or owner buckets
    # whose listed owners ascend and tile the bucket.
    pos = 0
    for i, b in enumerate(buffer.buckets):
        assert b.index == i and b.start == pos and b.numel > 0
        if b.owners:
            ranks = [r for r, _, _ in b.shards()]
            assert ranks == sorted(set(ranks)) and 0 <= ranks[0] and ranks[-1] < k
            assert [lo for _, lo, _ in b.shards()][0] == b.start
            assert all(hi > lo and lo % align == 0 for _, lo, hi in b.shards())
            assert sum(b.shard_len(r) for r in range(k)) == b.numel
        else:
            assert b.numel == k * b.shard_numel and b.shard_numel % align == 0
        pos = b.end
    assert buffer.numel == pos

    # Placements: spec order, exact sizes, aligned, inside one shard, owner by the offset rule.
    assert [(p.name, p.shape) for p in buffer.placements] == [(s.name, s.shape) for s in specs]
    for s, p in zip(specs, buffer.placements, strict=True):
        b = buffer.buckets[p.bucket]
        assert p.end - p.start == s.numel and p.start % align == 0
        if b.owners:
            owner = next(r for r, lo, hi in b.shards() if lo <= p.start < hi)
        else:
            owner = (p.start - b.start) // b.shard_numel
        assert p.owner == owner and 0 <= owner < k
        lo, hi = b.shard(owner)
        assert lo <= p.start and p.end <= hi, f"{p.name} leaves shard {owner}"

    # No two params share an element.
    spans = sorted((p.start, p.end) for p in buffer.placements)
    assert all(a[1] <= c[0] for a, c in zip(spans, spans[1:], strict=False)), "overlap"

    # Rank r owns exactly the params that lie in its shards, whole.
    for r in sorted({0, k // 2, k - 1}):
        mine = [(p, 0, p.numel) for p in buffer.placements if p.owner == r]
        assert list(buffer.owned(r)) == mine

    # Backprop order: bucket b holds the last-registered param not in buckets < b.
    members: list[list[int]] = [[] for _ in buffer.buckets]
    for i, p in enumerate(buffer.placements):
        members[p.bucket].append(i)
    remaining = set(range(len(specs)))
    for idx in members:
        assert idx and max(remaining) in idx
        remaining -= set(idx)

    # Tied params sit alone at the start of a bucket whose shard is exactly their aligned size.
    for i, (s, p) in enumerate(zip(specs, buffer.placements, strict=True)):
        if s.tied:
            b = buffer.buckets[p.bucket]
            assert members[p.bucket] == [i] and p.start == b.start
            assert b.shard_len(p.owner) == round_up(s.numel, align)

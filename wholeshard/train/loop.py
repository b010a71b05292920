"""`train(config, hooks)`: the worker function every rank runs, under `wholeshard.launch` or
torchrun.

One code path for any world size: it uses the process group that is already initialised
(`wholeshard.launch`), else initialises one from torchrun's environment (NCCL on CUDA, gloo on
CPU), else runs as a single process. The file holds the whole job (set-up, build, the loop,
evaluation, checkpoint save/resume, trace) so one can follow a step from top to bottom; that is
why it runs past 400 lines.

[Note: hooks]
`train(config, hooks)` calls every `hook(point, step, rank)` on every rank at two points of a
step: `BEFORE_SAVE` just before a checkpoint save starts (on steps that save), and `AFTER_STEP`
once the step's update, and its checkpoint if any, is done. Hooks watch the run or stop it
(the tests make a rank raise or die there, or arm a fault inside the save that follows
`BEFORE_SAVE`); they must not change training state.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from wholeshard.optim import LayerwiseOptimizer
from wholeshard.optim._agreement import peak_norms
from wholeshard.routing import routing_summary
from wholeshard.train import data, report
from wholeshard.train.config import TrainConfig
from wholeshard.train.model import GPT, VOCAB, model_config, num_params
from wholeshard.train.plot import plot_losses
from wholeshard.train.schedule import make_scheduler

ADAMW_BETAS = (0.9, 0.95)

BEFORE_SAVE, AFTER_STEP = "before_save", "after_step"
Hook = Callable[[str, int, int], None]
"""`hook(point, step, rank)`; see [Note: hooks]."""


@dataclass(frozen=True)
class Dist:
    """Where this process sits: rank, world size, device, and whether we own the group."""

    rank: int
    world: int
    local_world: int
    device: torch.device
    owns_group: bool


def torchrun_env() -> bool:
    """True when the environment describes a launched world (torchrun or `wholeshard.launch`)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def setup_distributed(timeout: timedelta | None = None) -> Dist:
    """Join the existing process group, or create one from torchrun's env (with collective
    `timeout`), or run alone."""
    owns = False
    if not dist.is_initialized() and torchrun_env():
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
        owns = True
    if not dist.is_initialized():
        return Dist(0, 1, 1, torch.device("cpu"), False)
    world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return Dist(dist.get_rank(), world, local_world, device, owns)


def fast_bf16(device: torch.device) -> bool:
    """Whether `device` has native bf16 matmuls (CUDA with bf16, or AVX512-BF16/AMX CPUs)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    except AttributeError:  # private helpers: absent means unknown, so stay in float32
        return False


def resolve_param_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype `--param-dtype` names; `auto` is bfloat16 where `fast_bf16`, else float32."""
    if name == "auto":
        return torch.bfloat16 if fast_bf16(device) else torch.float32
    return getattr(torch, name)


def _set_threads(cfg: TrainConfig, env: Dist) -> None:
    if env.device.type != "cpu":
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(cfg.threads or max(1, (cores or 1) // env.local_world))


@dataclass
class Trainee:
    """What the loop drives: the model, the module to call, the optimizer, grad clipping.

    bfloat16 compute: the muon path keeps bf16 params in wholeshard's buffers with fp32 masters
    in the optimizer; the adamw path keeps fp32 params and runs forward/backward under
    `torch.autocast` (`autocast` is then bfloat16), so both keep fp32 optimizer maths.
    """

    model: GPT
    module: nn.Module
    opt: torch.optim.Optimizer
    clip: Callable[[float], torch.Tensor]
    params: int  # counted before wrapping: a fully sharded wrapper releases params
    autocast: torch.dtype | None = None
    param_dtype: torch.dtype = torch.float32
    comm_wait_s: Callable[[], float] = lambda: math.nan
    """Seconds this rank has waited on collectives so far; nan where not measured (torch DDP)."""
    on_nonfinite: str = "error"

    def step(self) -> bool:
        """The optimizer step; True when skipped for non-finite gradients (`on_nonfinite` skip).
        Raises FloatingPointError naming the param under `error`, on every rank."""
        if isinstance(self.opt, LayerwiseOptimizer):  # it checks, with every rank
            before = self.opt.skipped_steps
            self.opt.step()
            return self.opt.skipped_steps > before
        # torch DDP: every rank holds the same averaged grads, so every rank finds the same.
        named = [(n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None]
        bad = (~torch.isfinite(peak_norms([g for _, g in named]))).nonzero() if named else []
        if len(bad) == 0:
            self.opt.step()
            return False
        if self.on_nonfinite == "skip":
            return True
        raise FloatingPointError(
            f"non-finite gradient: {named[int(bad[0])][0]!r} is the first param whose averaged "
            f"gradient has an inf or nan"
        )

    def loss(self, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy of the next byte, in nats."""
        with torch.autocast(x.device.type, self.autocast, enabled=self.autocast is not None):
            logits = self.module(x)
        return F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1), reduction=reduction)


def build(cfg: TrainConfig, env: Dist) -> Trainee:
    """The model, wrapped for data parallelism, and its optimizer, as `cfg.optimizer` says."""
    torch.manual_seed(cfg.seed)  # identical init on every rank
    model = GPT(model_config(cfg.model, cfg.seq_len, cfg.pos, cfg.tie)).to(env.device)
    params = num_params(model)
    if cfg.fp8 is not None:
        from wholeshard import fp8

        fp8.convert(model, cfg.fp8)
    dtype = resolve_param_dtype(cfg.param_dtype, env.device)
    lr, wd = cfg.peak_lr, cfg.weight_decay
    if cfg.optimizer == "muon":
        import wholeshard

        wrapped = wholeshard.DataParallel(
            model,
            bucket_size=cfg.bucket_size,
            param_dtype=dtype,
            overlap_grad_reduce=cfg.overlap,
            overlap_param_gather=cfg.overlap,
            scheme=cfg.scheme,
            param_sync=cfg.param_sync,
            reshard_after_forward=cfg.reshard_after_forward,
            fp8_param_gather=cfg.fp8 is not None,
            separate_all_gather_group=cfg.separate_all_gather_group,
        )
        opt = wholeshard.LayerwiseOptimizer(
            wrapped,
            muon=dict(lr=lr, adjust_lr_fn="match_rms_adamw", weight_decay=wd, momentum=0.95),
            adamw=dict(lr=lr, betas=ADAMW_BETAS, weight_decay=wd),
            nonfinite=cfg.on_nonfinite,
        )
        return Trainee(
            model,
            wrapped,
            opt,
            opt.clip_grad_norm_,
            params,
            param_dtype=dtype,
            comm_wait_s=lambda: wrapped.comm_wait_s,
            on_nonfinite=cfg.on_nonfinite,
        )
    wrapped: nn.Module = model
    if env.world > 1:
        kwargs = {}
        if cfg.bucket_size is not None:
            kwargs["bucket_cap_mb"] = cfg.bucket_size * 4 / 2**20  # fp32 grads
        ids = [env.device] if env.device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=ADAMW_BETAS, weight_decay=wd)

    def clip(max_norm: float) -> torch.Tensor:
        return nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    autocast = dtype if dtype != torch.float32 else None
    return Trainee(
        model, wrapped, opt, clip, params, autocast, dtype, on_nonfinite=cfg.on_nonfinite
    )


def _global_mean(t: torch.Tensor, env: Dist) -> float:
    if env.world > 1:
        t = t.detach().clone()
        dist.all_reduce(t)
        t /= env.world
    return t.item()


@torch.no_grad()
def evaluate(t: Trainee, batches: list, env: Dist) -> float:
    """Mean loss per byte over every rank's validation windows."""
    t.module.eval()
    total = torch.zeros(2, dtype=torch.float64, device=env.device)
    for x, y in batches:
        x, y = x.to(env.device), y.to(env.device)
        total[0] += t.loss(x, y, reduction="sum").double()
        total[1] += y.numel()
    if env.world > 1:
        dist.all_reduce(total)
    t.module.train()
    return (total[0] / total[1]).item()


def train(cfg: TrainConfig, hooks: Sequence[Hook] = ()) -> dict:
    """Run the training job on this rank; returns the run summary (the same on every rank).

    `hooks` are called as [Note: hooks] says."""
    cfg.validate()
    env = setup_distributed(timedelta(seconds=cfg.collective_timeout))
    try:
        return _train(cfg, env, hooks)
    finally:
        if env.owns_group:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, env: Dist, hooks: Sequence[Hook]) -> dict:
    t_start = time.perf_counter()
    _set_threads(cfg, env)
    if cfg.batch_size % env.world:
        raise ValueError(f"batch_size={cfg.batch_size} is not divisible by world={env.world}")
    corpus = data.load_corpus(cfg.data)
    val = data.val_batches(
        corpus.val, cfg.eval_batches, cfg.batch_size, cfg.seq_len, env.rank, env.world
    )
    t = build(cfg, env)
    sched = make_scheduler(t.opt, cfg.steps, cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio)
    out = cfg.out or report.default_out_dir()
    resumed = _resume(cfg, t, sched) if cfg.resume is not None else None
    start = 1 if resumed is None else resumed["step"] + 1
    log = report.RunLog(
        out,
        cfg.steps,
        enabled=env.rank == 0,
        progress=cfg.progress,
        resume_step=None if resumed is None else resumed["step"],
    )
    log.note(
        f"wholeshard train: {cfg.model} GPT ({t.params / 1e6:.2f}M params), "
        f"{cfg.optimizer}, {env.world} rank(s) on {env.device.type} "
        f"({str(t.param_dtype).removeprefix('torch.')}); data: {corpus.source} "
        f"({corpus.files} files, {len(corpus.train) + len(corpus.val)} bytes); out: {out}"
    )
    if cfg.optimizer == "muon":
        log.note(routing_summary(t.module.routes))
    tokens_per_step = cfg.batch_size * cfg.seq_len
    max_norm = cfg.clip_grad if cfg.clip_grad > 0 else math.inf
    tracer = _tracer(cfg, env)
    try:
        if resumed is None:
            first_val = last_val = evaluate(t, val, env)
            log.record({"step": 0, "val_loss": first_val, "lr": 0.0, "tokens": 0})
            if cfg.max_restarts:  # so that every restart resumes from a checkpoint
                _save(cfg, t, sched, 0, first_val, last_val, skipped_steps=0)
        else:
            first_val, last_val = resumed["first_val"], resumed["last_val"]
            log.note(f"resumed from {resumed['path']} at step {resumed['step']}")
        loss_value = math.nan
        skipped_steps = 0 if resumed is None else resumed.get("skipped_steps", 0)
        for step in range(start, cfg.steps + 1):
            t0 = time.perf_counter()
            waited = t.comm_wait_s()
            x, y = data.train_batch(
                corpus.train, step, cfg.batch_size, cfg.seq_len, cfg.seed, env.rank, env.world
            )
            loss = t.loss(x.to(env.device), y.to(env.device))
            loss_value = _global_mean(loss, env)
            if not math.isfinite(loss_value):
                raise FloatingPointError(
                    f"non-finite loss ({loss_value}) at step {step}: stopped before the update; "
                    f"nothing was saved at this step"
                )
            loss.backward()
            grad_norm = t.clip(max_norm)
            lr = t.opt.param_groups[0]["lr"]
            try:
                skipped = t.step()
            except FloatingPointError as e:
                raise FloatingPointError(f"at step {step}: {e}") from None
            skipped_steps += skipped
            t.opt.zero_grad(set_to_none=True)
            sched.step()
            if tracer is not None:
                tracer.step()
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                for hook in hooks:
                    hook(BEFORE_SAVE, step, env.rank)
                _save(cfg, t, sched, step, first_val, last_val, skipped_steps)
            for hook in hooks:
                hook(AFTER_STEP, step, env.rank)
            evaluating = step % cfg.eval_every == 0 or step == cfg.steps
            if not (evaluating or skipped or step % cfg.log_every == 0):
                continue
            step_s = time.perf_counter() - t0
            rec = {
                "step": step,
                "loss": loss_value,
                "lr": lr,
                "grad_norm": grad_norm.item(),
                "tokens": step * tokens_per_step,
                "tokens_per_s": tokens_per_step / step_s,
                "step_s": step_s,
                "comm_wait_s": t.comm_wait_s() - waited,
            }
            if skipped:
                rec["skipped"] = True
            if evaluating:
                last_val = rec["val_loss"] = evaluate(t, val, env)
            log.record(rec)
        wall_s = time.perf_counter() - t_start
        summary = {
            "steps": cfg.steps,
            "final_loss": loss_value,
            "final_val_loss": last_val,
            "skipped_steps": skipped_steps,
            "first_val_loss": first_val,
            "tokens": cfg.steps * tokens_per_step,
            "wall_s": wall_s,
            "world_size": env.world,
            "optimizer": cfg.optimizer,
            "model": cfg.model,
            "params": t.params,
            "param_dtype": str(t.param_dtype).removeprefix("torch."),
            "seed": cfg.seed,
            "lr": cfg.peak_lr,
            "batch_size": cfg.batch_size,
            "seq_len": cfg.seq_len,
            "tokens_per_s": cfg.steps * tokens_per_step / wall_s,
            "data": corpus.source,
            "out": str(out),
        }
        log.write_json(report.SUMMARY, summary)
        if log.enabled:
            title = f"{cfg.model} GPT, {cfg.optimizer}, {env.world} rank(s)"
            plot_losses(log.records, os.path.join(out, report.PLOT), title)
        return summary
    finally:
        if tracer is not None:
            tracer.stop()
        log.close()


TRACE_STEPS = 3  # steps recorded by --trace, after one warm-up step


def _tracer(cfg: TrainConfig, env: Dist):
    """A started torch.profiler that writes `cfg.trace` (rank 0) after a few steps, or None."""
    if cfg.trace is None:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    def write(prof) -> None:
        if env.rank == 0:
            prof.export_chrome_trace(cfg.trace)

    activities = [ProfilerActivity.CPU]
    if env.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=1, active=TRACE_STEPS, repeat=1),
        on_trace_ready=write,
    )
    prof.start()
    return prof


def _save(
    cfg: TrainConfig,
    t: Trainee,
    sched,
    step: int,
    first_val: float,
    last_val: float,
    skipped_steps: int,
):
    from wholeshard.checkpoint import save_checkpoint

    extra = {
        "step": step,
        "skipped_steps": skipped_steps,
        "scheduler": sched.state_dict(),
        "rng": torch.get_rng_state(),
        "first_val": first_val,
        "last_val": last_val,
    }
    save_checkpoint(cfg.checkpoint_dir, t.module, t.opt, extra=extra, keep_last=cfg.keep_last)


def _resume(cfg: TrainConfig, t: Trainee, sched) -> dict:
    """Load `cfg.resume` into the model, optimizer and scheduler; returns its `extra`.

    The data position is the step: batch `s` is a pure function of (seed, s, rank, world).
    """
    from wholeshard.checkpoint import load_checkpoint, resolve_checkpoint

    path = resolve_checkpoint(cfg.resume_path)
    extra = load_checkpoint(path, t.module, t.opt)
    sched.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["rng"])
    return dict(extra, path=str(path))

"""`train(config, hooks)`: the job every rank runs, under `wholeshard.distributed.launch` or
torchrun; `Trainer` is that job on one rank.

One code path for any world size: it uses the process group that is already initialised
(`wholeshard.distributed.launch`), else initialises one from torchrun's environment (NCCL on
CUDA, gloo on CPU), else runs as a single process.

[Note: hooks]
`train(config, hooks)` calls every `hook(point, step, rank)` on every rank at two points of a step:
`BEFORE_SAVE` just before a checkpoint save starts (on steps that save), and `AFTER_STEP` once the
step's update, and its checkpoint if any, is done (a background save: staged, its write maybe still
going on). Hooks watch the run or stop it (the tests make a rank raise or die there, or arm a fault
inside the save that follows `BEFORE_SAVE`); they must not change training state.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from ..distributed import stop
from ..planning.routing import routing_summary
from . import data, outputs
from .baseline import build_ddp_adamw, step_or_skip
from .checkpoints import RunCheckpoints
from .config import TrainConfig
from .elastic import WORLD_SIZE, WorldChange, world_change
from .env import (
    DistEnv,
    GlobalMean,
    all_ok,
    resolve_param_dtype,
    set_threads,
    setup_distributed,
    torchrun_restart_warning,
)
from .lr_schedule import lr_factor
from .model import JobModel, build_model
from .newton_schulz import NewtonSchulz
from .resume import AUTO, check_start, find_checkpoint

BEFORE_SAVE, AFTER_STEP = "before_save", "after_step"
Hook = Callable[[str, int, int], None]
"""`hook(point, step, rank)`; see [Note: hooks]."""
PROGRESS = ("first_val", "last_val", "last_loss", "skipped_steps")
"""What a run keeps across resumes besides the training state (in each checkpoint's `extra`)."""


def train(cfg: TrainConfig, hooks: Sequence[Hook] = ()) -> dict:
    """Run the training job on this rank; returns the run summary (the same on every rank).

    `hooks` are called as [Note: hooks] says."""
    cfg.validate()
    env = setup_distributed(timedelta(seconds=cfg.reliability.collective_timeout))
    try:
        return Trainer(cfg, env, hooks).train()
    finally:
        if env.owns_group:
            dist.destroy_process_group()


class Trainer:
    """The job on one rank: the data, the model wrapped for data parallelism, its optimizer and
    schedule, its checkpoints; `train()` runs the loop (`train_step`, `evaluate`, a save) and
    returns the summary.

    bfloat16 compute: the muon path keeps bf16 params in wholeshard's buffers with fp32 masters
    in the optimizer; the adamw path keeps fp32 params and runs forward/backward under
    `torch.autocast`, so both keep fp32 optimizer maths.
    """

    job: JobModel  # the model as built, its vocab, tokenizer and forward
    model: nn.Module  # job.module, on the device
    module: nn.Module  # what the loop calls: the wrapper, or the model itself
    opt: torch.optim.Optimizer
    clip: Callable[[float], torch.Tensor]  # clips the averaged gradients; returns their norm
    params: int  # counted before wrapping: a fully sharded wrapper releases params
    param_dtype: torch.dtype
    autocast: torch.dtype | None  # the adamw path's compute dtype under autocast
    newton_schulz: NewtonSchulz | None  # how the muon rule runs it (muon path, `muon` only)

    def __init__(self, cfg: TrainConfig, env: DistEnv, hooks: Sequence[Hook] = ()) -> None:
        self.start_time = time.perf_counter()
        self.cfg, self.env, self.hooks = cfg, env, hooks
        set_threads(cfg.threads, env)
        self.data_world = cfg.data_parallel_size(env.world)  # tp ranks share a batch
        self.batch = cfg.batch_split(self.data_world)
        self.out = cfg.output.out or outputs.default_out_dir()
        self._build()
        self.corpus = self._load_data()
        d, evals = cfg.data, cfg.output.eval_batches
        self.val = data.val_batches(
            self.corpus.val, evals, d.batch_size, d.seq_len, self.data_rank, self.data_world
        )
        schedule = cfg.lr_schedule  # applied to every param group's initial lr
        self.scheduler = LambdaLR(self.opt, lambda s: lr_factor(s, **schedule))
        ns = self.newton_schulz
        self.checkpoints = RunCheckpoints(cfg, self.module, self.opt, self.scheduler, ns, self.job)

    def _load_data(self) -> data.Corpus:
        """The text as bytes or token ids; local rank 0 tokenizes (once: a cache) while the
        others wait, and every rank raises if it failed."""
        from .tokens import load_data

        cfg, env = self.cfg, self.env
        beside = os.path.dirname(os.path.abspath(self.out))
        return load_data(
            cfg.data,
            tokenizer=self.job.tokenizer,
            vocab_size=self.job.vocab_size,
            cache_dir=cfg.data.cache_dir or os.path.join(beside, "token-cache"),
            builder=env.rank % env.local_world == 0,
            agree=lambda ok: all_ok(ok, env),
            progress=env.rank == 0 and cfg.output.progress,
        )

    def _build(self) -> None:
        """The model, wrapped for data parallelism, and its optimizer, as `cfg.optim` says."""
        cfg, env = self.cfg, self.env
        self.job = build_model(cfg)
        self.model = self.job.module.to(env.device)
        self.params = sum(p.numel() for p in self.model.parameters())  # a tied one once
        if cfg.model.fp8 is not None:
            from ..fp8 import convert

            convert(self.model, cfg.model.fp8)
        self.param_dtype = resolve_param_dtype(cfg.model.param_dtype, env.device)
        self.autocast, self.newton_schulz = None, None
        self.data_rank, mesh = env.rank, None
        if cfg.tp > 1:  # ranks (dp, tp) in row-major order: tp peers are consecutive
            from torch.distributed.device_mesh import init_device_mesh

            from ..models.gpt import parallelize_blocks

            shape = (self.data_world, cfg.tp)
            mesh = init_device_mesh(env.device.type, shape, mesh_dim_names=("dp", "tp"))
            parallelize_blocks(self.model, mesh["tp"])
            self.data_rank = mesh.get_local_rank("dp")
        if cfg.optim.name == "muon":
            from .muon_path import build_wholeshard

            built = build_wholeshard(self.model, cfg, self.param_dtype, mesh)
            self.module, self.opt, self.clip, self.newton_schulz = built
            return
        self.module, self.opt, self.clip = build_ddp_adamw(
            self.model, env, cfg.peak_lr, cfg.optim.weight_decay, cfg.parallel.bucket_size
        )
        if self.param_dtype != torch.float32:
            self.autocast = self.param_dtype

    def comm_wait_s(self) -> float:
        """Seconds this rank has waited on collectives so far; nan where not measured."""
        return getattr(self.module, "comm_wait_s", math.nan)

    # -- one step -----------------------------------------------------------------------------

    def loss(self, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy of the next token (byte), in nats; with `mean`, plus the model's
        auxiliary loss (an MoE router's) when it has one."""
        with torch.autocast(x.device.type, self.autocast, enabled=self.autocast is not None):
            logits, aux = self.job.forward(self.module, x)
        vocab = logits.shape[-1]
        ce = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1), reduction=reduction)
        return ce if aux is None or reduction != "mean" else ce + aux.float()

    def train_step(self, step: int) -> dict[str, Any]:
        """Forward, backward, clip, update and schedule for `step`; returns its figures. Raises
        FloatingPointError on a non-finite loss (before the update) or gradient (policy error)."""
        cfg = self.cfg
        mean = self._forward_backward(step)
        loss = mean.value()
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"non-finite loss ({loss}) at step {step}: stopped before the update; "
                f"nothing was saved at this step"
            )
        max_norm = cfg.optim.clip_grad if cfg.optim.clip_grad > 0 else math.inf
        grad_norm = self.clip(max_norm)
        lr = self.opt.param_groups[0]["lr"]
        try:
            skipped = self._update()
        except FloatingPointError as e:
            raise FloatingPointError(f"at step {step}: {e}") from None
        self.opt.zero_grad(set_to_none=True)
        self.scheduler.step()
        return dict(loss=loss, lr=lr, grad_norm=grad_norm, skipped=skipped, stop=mean.flagged())

    def _forward_backward(self, step: int) -> GlobalMean:
        """Gradients of this rank's share of `step`'s batch, in `self.batch.accumulation`
        micro-batches (all but the last under `no_sync`: reduced once); returns the mean loss
        over the global batch, its all-reduce started before the last backward."""
        cfg, env, split = self.cfg, self.env, self.batch
        d, rank, world = cfg.data, self.data_rank, self.data_world
        x, y = data.train_batch(
            self.corpus.train, step, d.batch_size, d.seq_len, cfg.seed, rank, world
        )
        micro = list(zip(x.split(split.micro), y.split(split.micro), strict=True))
        losses: list[torch.Tensor] = []

        def forward(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
            loss = self.loss(*data.on_device(env.device, xs, ys))
            loss = loss / split.accumulation if split.accumulation > 1 else loss
            losses.append(loss.detach())
            return loss

        if len(micro) > 1:
            no_sync = getattr(self.module, "no_sync", contextlib.nullcontext)  # (bare: 1 rank)
            with no_sync():
                for xs, ys in micro[:-1]:
                    forward(xs, ys).backward()
        loss = forward(*micro[-1])
        mean = GlobalMean(sum(losses), env, flag=stop.requested())
        loss.backward()
        return mean

    def _update(self) -> bool:
        """The optimizer step; True when skipped for non-finite gradients (policy skip)."""
        if isinstance(self.opt, torch.optim.AdamW):
            return step_or_skip(self.model, self.opt, self.cfg.optim.on_nonfinite)
        before = self.opt.skipped_steps  # LayerwiseOptimizer checks, with every rank
        self.opt.step()
        return self.opt.skipped_steps > before

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss per byte over every rank's validation windows."""
        env = self.env
        self.module.eval()
        total = torch.zeros(2, dtype=torch.float64, device=env.device)
        for x, y in self.val:
            x, y = data.on_device(env.device, x, y)
            total[0] += self.loss(x, y, reduction="sum").double()
            total[1] += y.numel()
        if env.world > 1:
            dist.all_reduce(total)
        self.module.train()
        return (total[0] / total[1]).item()

    # -- the job ----------------------------------------------------------------------------------

    def train(self) -> dict:
        """Run (or resume) the job to `optim.steps`; returns the summary. Checks where it starts
        on every rank first (`resume.check_start`); after construction, whose collectives order
        it after `wholeshard train --overwrite` removed old checkpoints on rank 0."""
        cfg, env = self.cfg, self.env
        ckpt = find_checkpoint(cfg)
        check_start(cfg, ckpt)
        replaced = env.rank == 0 and ckpt is None and outputs.existing_run(self.out)
        resumed = None if ckpt is None else self.checkpoints.resume(ckpt)
        log = outputs.RunLog(
            self.out,
            cfg.optim.steps,
            enabled=env.rank == 0,
            progress=cfg.output.progress,
            resume_step=None if resumed is None else resumed["step"],
        )
        last = log.last_logged
        change = None if resumed is None else world_change(resumed, env.world, self.batch, last)
        self._announce(log, change)
        auto = "--resume auto: " if cfg.checkpoint.resume == AUTO else ""
        if auto and ckpt is None:
            log.note(
                f"{auto}no checkpoint in {cfg.checkpoint_dir}; starting at step 0"
                + (f", replacing the run in {self.out}" if replaced else "")
            )
        tracer = outputs.start_trace(cfg.output.trace, env.rank, env.device.type == "cuda")
        try:
            if resumed is None:
                first_val = self.evaluate()
                log.record({"step": 0, "val_loss": first_val, "lr": 0.0, "tokens": 0})
                progress = dict(
                    first_val=first_val, last_val=first_val, last_loss=math.nan, skipped_steps=0
                )
                progress[WORLD_SIZE] = env.world  # each checkpoint records the world saving it
                if cfg.reliability.max_restarts:  # so that every restart resumes from one
                    self.checkpoints.save(0, progress)
                start = 1
            else:
                log.note(f"{auto}resumed from {resumed['path']} at step {resumed['step']}")
                for warning in resumed["warnings"]:
                    log.note(f"wholeshard train: {warning}")
                progress = {k: resumed.get(k, math.nan) for k in PROGRESS}
                progress["skipped_steps"] = resumed.get("skipped_steps", 0)
                progress[WORLD_SIZE] = env.world
                start = resumed["step"] + 1
            for step in range(start, cfg.optim.steps + 1):
                self._step_and_log(step, progress, log, tracer)
                if change:  # the first step at the new world size is done
                    log.event(change.event(step))
                    change = None
            self.checkpoints.wait()  # the last checkpoint is complete before the run says it ended
            return self._finish(log, progress)
        except BaseException:
            self.checkpoints.wait(log)  # a save in flight still completes: where a resume starts
            raise
        finally:
            if tracer is not None:
                tracer.stop()
            log.close()

    def _announce(self, log: outputs.RunLog, change: WorldChange | None) -> None:
        cfg, env, corpus = self.cfg, self.env, self.corpus
        log.note(
            f"wholeshard train: {self.job.label} ({self.params / 1e6:.2f}M params), "
            f"{cfg.optim.name}, {env.world} rank(s) on {env.device.type} "
            f"({str(self.param_dtype).removeprefix('torch.')}); data: {corpus.source} "
            f"({corpus.files} files, {len(corpus.train) + len(corpus.val):,} {corpus.unit}); "
            f"out: {self.out}"
        )
        notes = [change.note() if change else f"batch: {self.batch.describe()}"]
        notes += [routing_summary(self.module.routes)] if cfg.optim.name == "muon" else []
        notes += [self.newton_schulz.describe()] if self.newton_schulz is not None else []
        notes += [f"wholeshard train: {w}" for w in [torchrun_restart_warning()] if w is not None]
        for note in notes:
            log.note(note)

    def _step_and_log(
        self, step: int, progress: dict[str, Any], log: outputs.RunLog, tracer: Any
    ) -> None:
        """One step, its evaluation, its checkpoint (with the hooks around it; after the
        evaluation, so that it holds the step's validation loss) and its metrics record."""
        cfg, t0, waited = self.cfg, time.perf_counter(), self.comm_wait_s()
        figures = self.train_step(step)
        if figures["stop"]:  # the interrupted path, on every rank: [Note: stopping at a step]
            log.note(f"wholeshard train: stopped after step {step}")
            raise KeyboardInterrupt
        progress["skipped_steps"] += figures["skipped"]
        progress["last_loss"] = figures["loss"]
        if tracer is not None:
            tracer.step()
        evaluating = step % cfg.output.eval_every == 0 or step == cfg.optim.steps
        eval_s = 0.0  # step_s leaves it out
        if evaluating:
            t_eval = time.perf_counter()
            progress["last_val"] = self.evaluate()
            eval_s = time.perf_counter() - t_eval
        save_s = None
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
            for hook in self.hooks:
                hook(BEFORE_SAVE, step, self.env.rank)
            t_save = time.perf_counter()
            self.checkpoints.save(step, progress)
            save_s = time.perf_counter() - t_save
        for hook in self.hooks:
            hook(AFTER_STEP, step, self.env.rank)
        if not (evaluating or figures["skipped"] or step % cfg.output.log_every == 0):
            return
        step_s = time.perf_counter() - t0 - eval_s
        tokens = cfg.data.batch_size * cfg.data.seq_len
        rec = {
            "step": step,
            "loss": figures["loss"],
            "lr": figures["lr"],
            "grad_norm": figures["grad_norm"].item(),
            "tokens": step * tokens,
            "tokens_per_s": tokens / step_s,
            "step_s": step_s,
            "comm_wait_s": self.comm_wait_s() - waited,
            "time": time.time(),
        }
        if figures["skipped"]:
            rec["skipped"] = True
        if save_s is not None:
            rec["save_s"] = save_s
        if evaluating:
            rec["val_loss"] = progress["last_val"]
        log.record(rec)

    def _finish(self, log: outputs.RunLog, progress: dict[str, Any]) -> dict:
        """The summary (written to summary.json) and the loss plot."""
        cfg, env = self.cfg, self.env
        summary = outputs.summary(
            cfg,
            progress,
            wall_s=time.perf_counter() - self.start_time,
            world_size=env.world,
            params=self.params,
            param_dtype=str(self.param_dtype).removeprefix("torch."),
            newton_schulz=self.newton_schulz and self.newton_schulz.name,
            newton_schulz_auto=self.newton_schulz and self.newton_schulz.figures(),
            data=self.corpus.source,
            out=str(self.out),
        )
        log.write_json(outputs.SUMMARY, summary)
        if log.enabled:
            title = f"{self.job.label}, {cfg.optim.name}, {env.world} rank(s)"
            outputs.plot_losses(log.records, os.path.join(self.out, outputs.PLOT), title)
        return summary

"""Run a function on N local worker processes joined in one process group (gloo by default; on
`device="cuda"` each worker first takes GPU `rank % device_count` as its current device).

The launcher is the single place that starts local workers (train job, bench, tests). It
guarantees: a worker that raises or dies takes the others down and its traceback reaches the
caller; Ctrl-C stops every worker, at once, or at their next step boundary when the caller
asks them to stop (`stop.request()`, [Note: stopping at a step]: each worker sees
`stop.requested()`); workers die with their parent, so nothing is orphaned; a worker exits as
soon as it is done, without interpreter finalization, and one that still exits abnormally fails
the launch ([Note: worker exit]).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import stop

_POLL_S = 0.05
_JOINED, _ALL_JOINED = "wholeshard/joined", "wholeshard/all_joined"  # store keys
_GRACE_S = 3.0
_RETURNED, _RAISED, _STOPPED = "returned", "raised", "stopped"  # how a worker's function ended


class WorkerFailed(RuntimeError):
    """A worker raised or died; `rank` and its `traceback` text say which and why."""

    def __init__(self, rank: int, traceback_text: str) -> None:
        super().__init__(f"worker rank {rank} failed:\n{traceback_text}")
        self.rank = rank
        self.traceback = traceback_text


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """SIGINT blocked for the calling thread while inside, and as it was after: one that came
    meanwhile is delivered then (POSIX; elsewhere nothing)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _worker(
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    nproc: int,
    store_path: str,
    results: Any,
    asked: Any,
    timeout_s: float,
    forked: bool,
    backend: str,
    device: str,
    env: dict[str, str],
) -> None:
    _die_with_parent()
    faulthandler.register(signal.SIGUSR1)  # the launcher asks for stacks before killing a hang
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    stop.listen(asked)
    if hasattr(signal, "pthread_sigmask"):  # (held since `launch` started it: see there)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        **env,
    )
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo traffic stays on loopback
    try:
        if forked:  # OpenMP's thread pool does not survive fork: a child using it can hang
            torch.set_num_threads(1)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
        dist.set_debug_level_from_env()  # read once at import: a forked worker has its parent's
        store = dist.FileStore(store_path, nproc)
        bound = None
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            if backend == "nccl":  # eager init on this rank's GPU, as the train job does
                bound = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=nproc,
            timeout=timedelta(seconds=timeout_s),
            device_id=bound,
        )
        _all_joined(store, nproc)
        # Plain pickle: the queue's own pickler would share tensors by file descriptor, which
        # dies with this process.
        results.put((rank, _RETURNED, pickle.dumps(fn(*args))))
    except KeyboardInterrupt:  # (SIGINT is ignored: `fn` stopped where it was asked to)
        results.put((rank, _STOPPED, b""))
    except BaseException:
        results.put((rank, _RAISED, traceback.format_exc()))
    _end(results, forked)


def _all_joined(store: dist.Store, nproc: int) -> None:
    """Return once all `nproc` workers have their process group. A worker whose function
    returns at once (a rank outside every group it uses) would otherwise exit, closing its
    sockets under a peer still connecting to it: gloo's "connectFullMesh failed ... Connection
    closed by peer" on that peer."""
    if store.add(_JOINED, 1) == nproc:
        store.set(_ALL_JOINED, "1")
    store.wait([_ALL_JOINED])


def _end(results: Any, forked: bool) -> None:
    """End a worker that sent its result or its traceback.

    [Note: worker exit]
    A worker leaves as soon as its function has returned or raised (a peer blocked on it, a
    pipeline stage waiting for a stage that raised, fails then and reports), and without
    interpreter finalization: a spawned one ends with `os._exit` once its message is in the
    pipe, as multiprocessing ends a forked one, so exit handlers (`atexit`) run in no worker.
    Finalization races gloo: a gloo worker thread that releases a finished collective may drop a
    tensor's last C++ reference, which decrefs its Python object and so takes the GIL; a thread
    taking the GIL during finalization is made to exit inside that noexcept destructor, and the
    process aborts: "terminate called without an active exception", SIGABRT (torch 2.13; core
    dump: `ProcessGroupGloo::runLoop` -> `~AsyncAllreduceWork` -> `TensorImpl::decref_pyobject`
    -> `gil_scoped_acquire`, the main thread in `Py_FinalizeEx`). A step that ends on its last
    collective, as `opt.step()` with no backward does, reaches exit soonest after it: 3 spawned
    runs in 65 aborted on 2 busy cores, 7 in 24 with gloo's threads pinned to idle time
    (`tests/distributed/test_launch_exit.py`).
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    if forked:
        return
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def exit_reason(code: int | None) -> str:
    """How a worker process ended, in words, from its exit code (negative: killed by a signal).

    [Note: dead peers on NCCL]
    On NCCL a collective whose peer died does not fail in `wait()`: the process group's watchdog
    thread notices it at the group's timeout, logs "Watchdog caught collective operation
    timeout" with the collective's sequence number, and aborts the process (SIGABRT; torch's
    default `TORCH_NCCL_ASYNC_ERROR_HANDLING=3`). The launcher (and torchrun, as "exitcode: -6")
    then reports that rank; the root cause is the first rank that died otherwise.
    """
    if code is None or code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    why = {
        "SIGABRT": ": on NCCL, the watchdog aborts a rank whose collective timed out, most likely "
        "because a peer died (its log says 'Watchdog caught collective operation timeout')",
        "SIGKILL": ": killed from outside (the out-of-memory killer sends SIGKILL)",
    }.get(name, "")
    return f"was killed by {name}{why}"


def _root_cause(procs: list[mp.process.BaseProcess], rank: int, text: str) -> WorkerFailed:
    """The failure to report when `rank` raised: a worker that already died without a result
    (killed, crashed) if there is one, since a peer's failed collective follows from it."""
    for r, p in enumerate(procs):
        if r != rank and p.exitcode not in (None, 0):
            return WorkerFailed(
                r, f"{exit_reason(p.exitcode)}, without a result\n(then rank {rank}: {text})"
            )
    return WorkerFailed(rank, text)


def _dump_stacks(procs: list[mp.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(0.5)


def _stop(procs: list[mp.process.BaseProcess]) -> None:
    procs = [p for p in procs if p.pid is not None]  # a failed start leaves the rest unstarted
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def launch(
    fn: Callable[..., Any],
    nproc: int,
    args: tuple = (),
    *,
    start_method: str = "spawn",
    timeout: float | None = None,
    collective_timeout_s: float = 300.0,
    backend: str = "gloo",
    device: str = "cpu",
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `nproc` local workers in one `backend` group; return per-rank values.

    `start_method="fork"` starts in milliseconds (tests); "spawn" is safe in any parent, and the
    only choice with `device="cuda"` (CUDA does not survive a fork). On "cuda" each worker's
    current device is GPU `rank % torch.cuda.device_count()` (several ranks share a GPU with
    gloo); with `backend="nccl"` its group is bound to it (NCCL needs one GPU per rank).
    `collective_timeout_s`: how long a collective of the group waits for its peers.
    `env`: environment variables each worker sets before it joins the group, e.g.
    `TORCH_DISTRIBUTED_DEBUG=DETAIL`, which checks every collective against every rank's before
    it runs and blocks, as NCCL would, where ranks issue them in another order across groups
    (it raises after `collective_timeout_s`).
    Raises WorkerFailed if a worker raises or exits abnormally (at its exit too, after its
    result: [Note: worker exit]), TimeoutError after `timeout` seconds; either way every worker
    is stopped first. A stop requested in this process meanwhile (`stop.request()`) reaches
    every worker within `_POLL_S`; once each has ended, by returning or by raising
    KeyboardInterrupt where it stopped, and one did the latter, this raises KeyboardInterrupt.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and start_method == "fork":
        raise ValueError("device='cuda' needs start_method='spawn': CUDA does not survive a fork")
    if backend == "nccl" and device != "cuda":
        raise ValueError("backend='nccl' needs device='cuda'")
    ctx = mp.get_context(start_method)
    forked = start_method == "fork"
    # A FileStore, not a TCPStore: a TCPStore server thread in this process could hold a lock
    # at fork time and leave a child's rendezvous hung.
    store_dir = tempfile.mkdtemp(prefix="wholeshard-launch-")
    store_path = os.path.join(store_dir, "store")
    results = ctx.Queue()
    asked = ctx.Event()  # the workers' `stop.requested()`
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                fn,
                args,
                rank,
                nproc,
                store_path,
                results,
                asked,
                collective_timeout_s,
                forked,
                backend,
                device,
                dict(env or {}),
            ),
            daemon=True,
        )
        for rank in range(nproc)
    ]
    values: dict[int, Any] = {}
    stopped: set[int] = set()  # workers whose function stopped where it was asked to
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        # A spawned worker imports for seconds before `_worker` ignores SIGINT; it starts with
        # SIGINT blocked (the mask is inherited), so a Ctrl-C then reaches only this process,
        # once the workers are started, and stops them here, with no traceback of theirs.
        with _sigint_held():
            for p in procs:
                p.start()
        while len(values) + len(stopped) < nproc:
            if stop.requested() and not asked.is_set():
                asked.set()
            try:
                rank, outcome, value = results.get(timeout=_POLL_S)
            except queue.Empty:
                ended = values.keys() | stopped
                dead = [r for r, p in enumerate(procs) if r not in ended and p.exitcode is not None]
                if not dead:
                    if deadline is not None and time.monotonic() > deadline:
                        _dump_stacks(procs)
                        raise TimeoutError(f"workers did not finish within {timeout} s") from None
                    continue
                try:  # a worker that reported just before exiting: its message may be in flight
                    rank, outcome, value = results.get(timeout=1.0)
                except queue.Empty:
                    code = procs[dead[0]].exitcode
                    raise WorkerFailed(dead[0], f"{exit_reason(code)}, without a result") from None
            if outcome == _RAISED:
                raise _root_cause(procs, rank, value)
            if outcome == _STOPPED:
                stopped.add(rank)
            else:
                values[rank] = pickle.loads(value)
        for rank, p in enumerate(procs):  # a crash at exit fails the launch too
            p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                _dump_stacks(procs)
                raise TimeoutError(f"workers did not exit within {timeout} s")
            if p.exitcode != 0:
                raise WorkerFailed(rank, f"{exit_reason(p.exitcode)} at exit, after its result")
        if stopped:
            raise KeyboardInterrupt
        return [values[r] for r in range(nproc)]
    finally:
        _stop(procs)
        results.close()
        shutil.rmtree(store_dir, ignore_errors=True)

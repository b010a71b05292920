"""Ctrl-C in the `wholeshard` command: exit 130 (128 + SIGINT) with one line on stderr, never a
traceback, whenever it comes.

Until a subcommand starts work that must be undone, SIGINT ends the process at once
(`exits_at_once`, which `wholeshard.cli.main` holds around everything): the first seconds are
imports, and a KeyboardInterrupt raised inside one can be swallowed or turned into another error
by an extension module's initialisation (torch's import of numpy does both), so the process does
not wait for it to surface. Work that cleans up on the way out (launched workers, an export's
partial output) runs under `raises`: SIGINT is a KeyboardInterrupt again, which `main` (or the
subcommand) reports in the same one line. A training job runs under `stops_at_a_step`: the first
SIGINT asks every rank to stop at the next step boundary, once the checkpoint being written is
complete ([Note: stopping at a step] in `wholeshard.distributed.stop`), and a second stops at
once. A SIGINT that is ignored (`nohup`, a background job) stays ignored; outside the main thread
these do nothing (signals are the main thread's).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

INTERRUPTED = 128 + signal.SIGINT
"""The exit code of an interrupted command, as the shell reports a process killed by SIGINT."""


def line(prog: str) -> str:
    """What an interrupted command prints: `wholeshard train: interrupted`."""
    return f"{prog}: interrupted"


@contextlib.contextmanager
def exits_at_once(prog: Callable[[], str]) -> Iterator[None]:
    """While inside, SIGINT writes `line(prog())` to stderr and ends the process with
    `INTERRUPTED`, running no more Python code (no `finally`, no atexit, no buffered output)."""
    with _handling(_exit_now(prog)):
        yield


def _exit_now(prog: Callable[[], str]) -> Callable[[int, object], None]:
    def handler(signum: int, frame: object) -> None:
        os.write(2, (line(prog()) + "\n").encode())
        os._exit(INTERRUPTED)

    return handler


@contextlib.contextmanager
def raises() -> Iterator[None]:
    """While inside, SIGINT raises KeyboardInterrupt (Python's default), for code that cleans up
    on its way out."""
    with _handling(signal.default_int_handler):
        yield


@contextlib.contextmanager
def stops_at_a_step(note: str | None, exit_as: str | None = None) -> Iterator[None]:
    """While inside, the first SIGINT asks the job to stop at its next step boundary
    (`wholeshard.distributed.stop.request()`) and writes `note`, if any, to stderr; a second
    raises KeyboardInterrupt or, with `exit_as` (a torchrun worker, which has no workers to stop),
    ends the process at once as `exits_at_once(lambda: exit_as)` does, abandoning a save in
    flight. The request is withdrawn on the way out."""
    from ..distributed import stop

    second = signal.default_int_handler if exit_as is None else _exit_now(lambda: exit_as)

    def handler(signum: int, frame: object) -> None:
        if stop.requested():
            second(signum, frame)
            return
        stop.request()
        if note is not None:
            os.write(2, (note + "\n").encode())

    try:
        with _handling(handler):
            yield
    finally:
        stop.withdraw()


@contextlib.contextmanager
def _handling(handler: Callable[[int, object], None]) -> Iterator[None]:
    """SIGINT goes to `handler` while inside, then to what it went to before."""
    previous = signal.getsignal(signal.SIGINT)
    mine = threading.current_thread() is threading.main_thread()
    if not mine or previous in (signal.SIG_IGN, None):  # (None: a handler not set from Python)
        yield
        return
    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)

"""A request to stop at the next step boundary: what the first Ctrl-C of `wholeshard train`
makes, in every process of the job.

[Note: stopping at a step]
A training rank is never interrupted wherever it happens to be: one that leaves a collective
its peers are in, or that they have not reached yet, leaves them waiting (ranks interrupted at
different points hang). The first Ctrl-C only asks: `request()` in the process that gets it (a
torchrun worker: torchrun's agent forwards SIGINT to each), which `launch` forwards to every
worker it started (an event they share). A job reads `requested()` once a step and agrees on it
with every rank in a collective the step makes anyway (the training job's loss all-reduce
carries it), so every rank stops after the same step, finishes the checkpoint being written in
the background, and raises KeyboardInterrupt there. A second Ctrl-C stops every process at once.
"""

from __future__ import annotations

from typing import Any

_asked = False
_shared: Any = None  # in a worker `launch` started: its event, set when the launcher is asked


def request() -> None:
    """Ask this process (and the workers it launches) to stop at the next step boundary."""
    global _asked
    _asked = True


def withdraw() -> None:
    """Forget the request made in this process (the command that made it is over)."""
    global _asked
    _asked = False


def requested() -> bool:
    """Whether this process was asked to stop: by `request()`, or by its launcher."""
    return _asked or (_shared is not None and _shared.is_set())


def listen(event: Any) -> None:
    """In a launched worker: requests come from the launcher, through `event` (a multiprocessing
    Event), and not from the state a forked worker inherited."""
    global _asked, _shared
    _asked, _shared = False, event

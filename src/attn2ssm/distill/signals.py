"""Stopping a run on a signal. SIGTERM / SIGINT (a scheduler's notice, Ctrl-C) stop the loop after
the current optimizer step: it is checkpointed, one line names the checkpoint and the resume
command, and the process exits 143 / 130. Several processes agree on the signal after each step, so
they all stop at the same one. Before the first step (loading the teacher, sampling its text,
building the student: minutes, with nothing to checkpoint) a signal stops at once."""

from __future__ import annotations

import contextlib
import signal

import torch

from attn2ssm.errors import Interrupted


@contextlib.contextmanager
def _handling(handler):
    """While the block runs, ``handler(signum, frame, previous)`` receives SIGTERM / SIGINT
    (``previous``: the handlers before, put back at the end)."""
    previous = {}
    try:
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.getsignal(signum) or signal.SIG_DFL
            signal.signal(signum, lambda signum, frame: handler(signum, frame, previous))
    except ValueError:  # not the main thread: signals cannot be caught here
        pass
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def asking_to_stop(asked: set[int]):
    """While the block runs, SIGTERM / SIGINT only add themselves to ``asked``. Ctrl-C twice
    interrupts at once (KeyboardInterrupt); a repeated SIGTERM is not hurried (torchrun sends
    its workers more than one), the scheduler's SIGKILL is what ends a grace period."""

    def ask(signum, frame, previous):
        if signum == signal.SIGINT and signum in asked:
            signal.signal(signum, previous[signum])
            signal.raise_signal(signum)
        asked.add(signum)

    return _handling(ask)


def stopping_at_once(asked: set[int], stop):
    """While the block runs, SIGTERM / SIGINT call ``stop(signum)`` at once (it raises), as does one
    asked before the block: for the work before a run's first step, which has nothing to checkpoint
    and can take minutes (the teacher sampling its text). Caches it writes are written atomically."""
    if asked:
        stop(max(asked))

    def now(signum, frame, previous):
        asked.add(signum)
        stop(signum)

    return _handling(now)


def agreed_signal(asked: set[int], acc) -> int:
    """The signal to stop on (0: none). Processes agree on it, so they all stop at the same step."""
    signum = max(asked, default=0)
    if acc.num_processes > 1:
        signum = int(acc.gather(torch.tensor([signum], device=acc.device)).max())
    return signum


def asked_flags(asked: set[int], device) -> list[torch.Tensor]:
    """Whether SIGTERM, SIGINT were asked, as float64 0-d tensors: summed over processes with a step's
    losses, so every process learns the others' signals in the step's one reduction."""
    return [
        torch.full((), float(signum in asked), dtype=torch.float64, device=device)
        for signum in (signal.SIGTERM, signal.SIGINT)
    ]


def signal_from_flags(term: float, interrupt: float) -> int:
    """``asked_flags`` summed over processes back to the signal to stop on (0: none)."""
    return signal.SIGTERM if term else signal.SIGINT if interrupt else 0


def interrupted(signum: int, where: str, checkpoint, resume_command: str) -> Interrupted:
    """The one line a stopped run ends with: the signal, where it stopped, its checkpoint, the resume command."""
    saved = f"checkpoint {checkpoint}" if checkpoint else "nothing trained yet, no checkpoint"
    return Interrupted(
        f"stopped by {signal.Signals(signum).name} at {where}: {saved}",
        f"resume with: {resume_command}",
        exit_code=128 + signum,
    )

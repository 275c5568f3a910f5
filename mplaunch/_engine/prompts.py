"""Where a rank's prompt is answered (a *front-end*), for _engine.debugging: the
kernel's input box, this process's terminal, or pytest's terminal under --pdb. Each
has ``opened()``/``closed()`` (a rank takes and gives back the turn), ``ask(prompt,
sel, answer)`` (show the prompt; call ``answer(line)``, None at end of input, now or
from the group's selector) and ``cancel(sel)``.
"""
from __future__ import annotations

import os
import selectors
import signal
import sys
import threading
from typing import List, Optional

from .terminal import stdin_is_terminal

# Set by the pytest plugin (under --pdb) for the test it runs: a front-end factory.
override = None


def note(text: str) -> None:
    """One line on this process's stderr (a note of mplaunch's about the ranks)."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass


class FrontEnd:
    """What every front-end does when a rank takes the turn, gives it back, or its
    question is withdrawn: nothing, unless it says otherwise."""

    def opened(self) -> None:
        pass

    def closed(self) -> None:
        pass

    def cancel(self, sel) -> None:
        pass


def choose(terminal: bool, broker):
    """The front-end for this call, or False for none."""
    if override is not None:
        return override()
    kernel = _kernel()
    if kernel is not None:
        return Kernel(broker) if getattr(kernel, "_allow_stdin", False) else False
    if terminal and stdin_is_terminal():
        return Terminal()
    return False


def _kernel():
    if "ipykernel" not in sys.modules:
        return None
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except Exception:  # noqa: BLE001
        return None
    return getattr(shell, "kernel", None)


class Kernel(FrontEnd):
    """A Jupyter kernel: the line is its ``input()``, the frontend's input box. It
    blocks this process's loop until the user answers (the kernel has nothing else to
    do meanwhile: the cell is this call); the kernel's interrupt raises in it.

    Only the main thread may ask (the kernel routes the request to the cell it runs
    there). A launch's monitor thread (``mplaunch.start``) leaves its prompts for the
    main thread, which answers them while it waits for the handle (``serve_deferred``,
    from ``Handle.wait``/``result``)."""

    def __init__(self, broker):
        self._broker = broker
        self._told = False

    def ask(self, prompt: str, sel, answer) -> None:
        broker = self._broker
        if threading.current_thread() is threading.main_thread():
            line, interrupted = _kernel_line(prompt)
            if interrupted:
                broker.on_interrupt()
            else:
                answer(line)
            return

        def deliver(line, interrupted):
            if interrupted:
                broker.post(broker.interrupt)
            else:
                broker.post(answer, line)
        with _deferred_lock:
            _deferred.append((broker, prompt, deliver))
        if not self._told:
            self._told = True
            note("mplaunch: a rank waits for you at a prompt; a cell that waits for "
                 "its launch (handle.result() or handle.wait()) shows it")


# Prompts of launches run by start() in a kernel, for the main thread (serve_deferred).
_deferred: List[tuple] = []
_deferred_lock = threading.Lock()


def serve_deferred() -> None:
    """In the main thread (Handle.wait): ask the kernel for the lines that launches
    running in other threads wait for."""
    while True:
        with _deferred_lock:
            if not _deferred:
                return
            _, prompt, deliver = _deferred.pop(0)
        line, interrupted = _kernel_line(prompt)
        deliver(line, interrupted)
        if interrupted:
            resignal()


def forget_deferred(broker) -> None:
    with _deferred_lock:
        _deferred[:] = [d for d in _deferred if d[0] is not broker]


def _kernel_line(prompt: str):
    """(the kernel's answer, or None at end of input; whether its interrupt came
    instead). Its interrupt raises while the input box is open, whatever handler
    this process has (the World's forwards it without raising)."""
    import builtins
    try:
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:   # not the main thread
        previous = None
    try:
        return builtins.input(prompt), False
    except EOFError:
        return None, False
    except KeyboardInterrupt:
        return None, True
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def resignal() -> None:
    """Hand an interrupt taken from input() to this process's SIGINT handler."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, None)
    else:
        raise KeyboardInterrupt


class Terminal(FrontEnd):
    """This process's terminal: the prompt to stdout, the line from fd 0, read on the
    group's selector as it comes."""

    _fd = 0

    def __init__(self):
        self._buf = b""
        self._answer = None
        self._sel = None

    def ask(self, prompt: str, sel, answer) -> None:
        try:
            sys.stdout.write(prompt)
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        self._answer, self._sel = answer, sel
        if self._take_line():
            return
        try:
            sel.register(self._fd, selectors.EVENT_READ, self._readable)
        except KeyError:
            pass

    def cancel(self, sel) -> None:
        self._answer = None
        try:
            sel.unregister(self._fd)
        except (KeyError, ValueError):
            pass

    def _readable(self, _fd) -> None:
        try:
            chunk = os.read(self._fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._deliver(None)
            return
        self._buf += chunk
        self._take_line()

    def _take_line(self) -> bool:
        if b"\n" not in self._buf:
            return False
        line, self._buf = self._buf.split(b"\n", 1)
        self._deliver(line.decode("utf-8", "replace"))
        return True

    def _deliver(self, line: Optional[str]) -> None:
        answer = self._answer
        if answer is None:
            return
        self.cancel(self._sel)   # typed-ahead lines wait in _buf for the next prompt
        answer(line)


class Suspending(Terminal):
    """The terminal, taken from whoever else holds it while a rank asks (pytest's
    capture): `suspend` when a rank takes the turn, `resume` when it gives it back."""

    moves_streams = True

    def __init__(self, suspend, resume):
        super().__init__()
        self._suspend, self._resume = suspend, resume

    def opened(self) -> None:
        self._suspend()

    def closed(self) -> None:
        self._resume()

"""The open line at the bottom of a terminal that several ranks' relays write to: one
relay at a time draws a line there that has not ended (a progress bar redrawn after
``\\r``, or a prompt waiting for input); the others' bars wait their turn, and whole lines
of any relay go above it. StreamRelay (_engine.output) inherits this part as OpenLine.

A file, a pipe, pytest's capture or a notebook's stream is drawn on the same way, except
that nothing can be erased there: a bar's line is ended (``\\n``) where it stands before
anything else is written, and the bar goes on, on a line of its own, when it next
changes. Leaving the line open and relying on ``\\r``, as on a terminal, put the next
rank's line at the end of the bar's in a log file. Where sys.stdout and sys.stderr go to
one file (``> log 2>&1``), that is one screen, as a terminal is: a line on stdout ends a
bar on stderr too, and each stream's buffer is flushed before the other is written.
mplaunch's own messages go through lines_above(), for the same reason.
"""
from __future__ import annotations

import contextlib
import io
import os
import threading
import weakref

MAX_PENDING = 1 << 20  # a "line" longer than this is relayed in pieces

# Held while a relay writes, and around lines_above(): the relays are fed by the thread
# that drives a launch, and a message of mplaunch's own may come from another (the
# watcher's SIGUSR1 report) while a relay is between drawing a bar and ending its line.
LOCK = threading.RLock()


def whole_chars(buf: bytes) -> bytes:
    """buf without a UTF-8 sequence cut short at its end."""
    for back in range(1, min(4, len(buf)) + 1):
        b = buf[-back]
        if b & 0xC0 != 0x80:  # the last sequence's first byte
            need = 4 if b >= 0xF0 else 3 if b >= 0xE0 else 2 if b >= 0xC0 else 1
            return buf[:-back] if need > back else buf
    return buf


class _Screen:
    """What the relays writing to one terminal (or to one other sink) share: which of
    them has an open line drawn at its bottom, the others' lines going above it.

    Only one: two ranks' bars drawn in turn on one line flicker between them and neither
    is readable. The others' bars wait (their final state is still printed when they
    end); when the drawn one ends, the first waiting one, in rank order, is drawn."""

    def __init__(self, key, ansi: bool):
        self.key = key
        # A terminal: lines can be erased ("\\x1b[K"), so an open line can be taken off
        # and drawn again below what others write, and a prompt can be shown.
        self.ansi = ansi
        self.relays: list = []   # weak references, in the order the relays were made
        self._owner = None
        self.last = None         # the sink written last (see switch_to)

    @property
    def owner(self):
        return self._owner() if self._owner is not None else None

    @owner.setter
    def owner(self, relay) -> None:
        self._owner = weakref.ref(relay) if relay is not None else None

    def switch_to(self, sink) -> None:
        """`sink` is written next. Where two objects write to one file (sys.stdout and
        sys.stderr of ``> log 2>&1``), what the other holds in its buffer goes out
        first: the file gets the lines in the order they were written."""
        if self.last is not sink:
            self.flush()
            self.last = sink

    def flush(self) -> None:
        if self.last is not None:
            try:
                self.last.flush()
            except Exception:  # noqa: BLE001 - a closed sink: nothing of ours is in it
                self.last = None


_screens: dict = {}


def screen_for(sink) -> _Screen:
    key, tty = ("sink", id(sink)), False
    try:
        if sink.isatty():
            # stdout and stderr (and any other object) on the same terminal: one screen.
            key, tty = ("tty", os.fstat(sink.fileno()).st_rdev), True
        elif isinstance(sink, io.TextIOWrapper):
            # The same for one file or pipe. Only for a wrapper whose writes go to its
            # fd: a notebook's stream has a fileno() too, of another destination.
            st = os.fstat(sink.fileno())
            key = ("file", st.st_dev, st.st_ino)
    except (AttributeError, OSError, ValueError):
        pass
    screen = _screens.get(key)
    if screen is None:
        screen = _screens[key] = _Screen(key, tty and os.environ.get("TERM") != "dumb")
    return screen


@contextlib.contextmanager
def lines_above():
    """Around a message of mplaunch's own, written to stdout or stderr outside the
    relays: every drawn open line is taken off first (or ended, where nothing can be
    erased), and what the relays wrote is flushed, so that the message starts a line
    of its own; the open lines are drawn again after it."""
    with LOCK:
        hidden = []
        for screen in list(_screens.values()):
            owner = screen.owner
            if owner is not None and owner.sink is not None:
                owner._hide()
                hidden.append(owner)
            screen.flush()
        try:
            yield
        finally:
            for owner in hidden:
                if owner._screen is not None and owner.sink is not None:
                    owner._redraw()


class OpenLine:
    """The open-line half of a StreamRelay: its methods use the relay's ``prefix``,
    ``sink``, ``_screen``, ``_pending`` (the line being received), ``_progress``,
    ``_state``, ``_drawn`` (the bar's latest state and what of it is drawn), ``_open``
    (where nothing can be erased: whether what is drawn is still the sink's last line,
    not ended), ``_shown`` (what of a prompt is shown), ``_prompts`` and ``_put``."""

    @property
    def is_terminal(self) -> bool:
        """Whether what this relay writes ends on a terminal."""
        return self._screen is not None and self._screen.key[0] == "tty"

    def terminal_size(self):
        """The size of the terminal this relay writes to (os.terminal_size), or None."""
        if not self.is_terminal:
            return None
        try:
            return os.get_terminal_size(self.sink.fileno())
        except (AttributeError, OSError, ValueError):
            return None

    def show_prompts(self) -> None:
        """This rank reads the terminal: show a line it has not finished as soon as it
        arrives (a prompt: ``input("name? ")``, pdb's ``(Pdb) ``), where the user's
        typing will be echoed, instead of waiting for its end like any other line.
        Only on a terminal: nobody can answer a prompt in a file."""
        if self._screen is not None and self._screen.ansi:
            self._prompts = True

    def _draw(self) -> None:
        """Show the open progress line's latest state in place, once per change, if the
        screen's open line is ours to draw."""
        now = whole_chars(bytes(self._pending)) or self._state
        if not now or now == self._drawn:
            return
        screen = self._screen
        owner = screen.owner
        if owner is None:
            screen.owner = self
        elif owner is not self:
            return  # another rank's bar or prompt is drawn; ours waits its turn
        self._drawn = now
        if screen.ansi:
            # With erase-to-end, a shorter state leaves nothing of the longer one behind.
            self._put(self.prefix + now + b"\x1b[K\r")
        else:
            # The \r goes before the next state, not after this one: the line is open
            # until it is ended with \n, never left looking ended (see _hide).
            self._put((b"\r" if self._open else b"") + self.prefix + now)
            self._open = True

    # -- the screen's open line ------------------------------------------------------
    def _hide(self) -> None:
        """Take our drawn line off the screen; the cursor is left at its start. Where
        nothing can be erased, end it where it stands: the bar's state stays in the file
        on its own line, and what comes next starts a line."""
        if self._screen.ansi:
            self._put(b"\r\x1b[K")
        elif self._open:
            self._open = False
            self._put(b"\n")

    def _ended_as(self, state: bytes) -> bool:
        """Whether `state` is already in the sink as a whole line: our bar, ended by
        _hide where nothing can be erased, has not changed since."""
        return (not self._open and state == self._drawn and self._screen is not None
                and not self._screen.ansi)

    def _redraw(self) -> None:
        if not self._screen.ansi:
            return  # its line was ended; it is drawn again on a new one when it changes
        if self._shown is not None:
            self._put(self.prefix + self._shown)
        elif self._drawn is not None:
            self._put(self.prefix + self._drawn + b"\x1b[K\r")

    def _release(self) -> None:
        """Our open line has ended: the first other relay with a bar open draws it."""
        screen = self._screen
        if screen is None or screen.owner is not self:
            return
        screen.owner = None
        for ref in screen.relays:
            relay = ref()
            if relay is not None and relay is not self and relay._progress \
                    and relay.sink is not None:
                relay._drawn = None
                relay._draw()
                if screen.owner is not None:
                    break

    def _show_prompt(self) -> None:
        """Show the unfinished line, taking the screen from a bar if need be: someone is
        perhaps expected to answer it."""
        screen = self._screen
        owner = screen.owner
        if owner is not None and owner is not self:
            if owner._shown is not None:
                # The other stream's prompt stays as it is; the rest of its line will
                # come as a whole line of its own.
                owner._put(b"\n")
                owner._shown = None
            else:
                owner._hide()
                owner._drawn = None  # drawn again when the screen is its turn
        screen.owner = self
        self._shown = whole_chars(bytes(self._pending))
        self._put(self.prefix + self._shown)

    def _continue_prompt(self, data: bytes) -> bytes:
        """More of the line shown as a prompt: write it after what is shown, as a
        plain pipe would (the user's answer was echoed there). Return what follows the
        line's end, to be relayed as usual."""
        nl = data.find(b"\n")
        cr = data.find(b"\r")
        if cr >= 0 and (nl < 0 or cr < nl):
            # Not a prompt but a progress bar: take it off; the line is relayed as one.
            self._hide()
            self._shown = None
            self._screen.owner = None
            return data
        if nl < 0 and len(self._pending) + len(data) <= MAX_PENDING:
            self._pending += data
            now = whole_chars(bytes(self._pending))
            self._put(now[len(self._shown):])
            self._shown = now
            return b""
        end = len(data) if nl < 0 else nl
        line = bytes(self._pending) + data[:end]
        self._put(line[len(self._shown):] + b"\n")
        self._pending = bytearray()
        self._shown = None
        self._release()
        return data[end + 1:]

    def _leave_screen(self) -> None:
        screen = self._screen
        if screen is None:
            return
        self._release()
        screen.relays = [ref for ref in screen.relays if ref() not in (None, self)]
        if not screen.relays and _screens.get(screen.key) is screen:
            del _screens[screen.key]
        self._screen = None

"""The rank's side: take over the process, apply the environment, run the function, send
one message, exit.

Order matters: the process group, the parent-death signal and the file descriptors are
set up before anything that can fail or run user code; the environment, cwd and
sys.path are applied before the payload is unpickled, so import-time code in the user's
modules sees the rank's environment.
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import sys
import time

from . import (cells, collectives, debugging, flight, heal, procgroup, reloads,
               rendezvous, call_loop as serving, streams)
from .frames import is_ours
# Imported here, not when first used: the server imports this module before it forks
# any rank (a forked rank finds them loaded), and every rank needs them.
from .._wire import buffers, linux, mainglobals, mainmod, payload as wire_payload
from .._wire.channel import send_framed
from .._wire.exceptions import pack_exception
from .._wire.messages import (EXIT_CHANNEL_CLOSED, EXIT_ERROR, EXIT_PARENT_GONE,
                              MESSAGE_TAG, RESULT_TAG, STACK_SIGNAL, KeptGlobals, Raised,
                              Returned)

# mplaunch's own plumbing: an interrupt is never raised in its frames (_rank.call_loop)
__mplaunch_plumbing__ = True


class _ChannelClosed(Exception):
    """The rank closed (or replaced) its result channel's fd: nothing reaches the parent."""


_TERMINATION_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGCHLD", "SIGPIPE",
                        "SIGUSR1", "SIGUSR2")


def _take_over_process(fds: dict, expected_ppid: int, terminal: dict,
                       unbuffered: bool) -> None:
    _lead_own_group(fds.get("stdin"))
    linux.set_pdeathsig(signal.SIGKILL)
    if os.getppid() != expected_ppid:
        # Our parent died before the death signal was armed: nobody would ever kill us.
        os._exit(EXIT_PARENT_GONE)
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass
    for name in _TERMINATION_SIGNALS:
        signo = getattr(signal, name, None)
        if signo is None:
            continue
        handler = signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL
        try:
            signal.signal(signo, handler)
        except (OSError, ValueError):
            pass
    streams.take_over(fds, terminal, unbuffered)
    faulthandler.enable(file=2, all_threads=True)
    faulthandler.register(STACK_SIGNAL, file=fds["stack"], all_threads=True, chain=False)
    collectives.set_stack_fd(fds["stack"])


def _lead_own_group(stdin) -> None:
    """Lead our own process group, so that teardown signals reach our descendants too.
    A rank that reads the terminal leads its own session: a background process group
    of the terminal's session (a rank forked by the launching process, start_method=
    "fork") is stopped (SIGTTIN) when it reads it; in a session of its own, reads are
    plain reads. (Ranks the server forks are in its session, which has no terminal.)"""
    if stdin is not None and os.isatty(stdin):
        try:
            os.setsid()
            return
        except OSError:
            pass  # already a group leader (our parent's setpgid came first)
    try:
        os.setpgid(0, 0)
    except OSError:
        pass


def _apply_spec(spec, forked_from_launcher: bool = False) -> None:
    os.environ.clear()
    os.environ.update(spec.env)
    if "SLURM_TASK_PID" in os.environ:
        # Each rank is a task of its own (_engine.env rewrites the others); under srun a
        # task's SLURM_TASK_PID is its own pid, known only here, not the launching
        # process's or its node agent's that the environment was copied from.
        os.environ["SLURM_TASK_PID"] = str(os.getpid())
    try:
        os.chdir(spec.cwd)
    except OSError:
        pass
    sys.path[:] = spec.sys_path
    if spec.script is not None:
        sys.argv[:] = spec.script.argv
    atexit._clear()  # handlers inherited from the forking process are not ours to run
    rendezvous.install_hook()
    if spec.cpus:
        # cpus=: before any user code, so that every thread it starts inherits the set.
        os.sched_setaffinity(0, spec.cpus)
    if forked_from_launcher:
        # Only a fork of the launching process has any (see there); it reads /proc.
        rendezvous.close_inherited_store_sockets()
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS")
    if torch is not None and threads and threads.isdigit() and int(threads) > 0:
        # torch was imported before the environment was applied (a warm forkserver), so
        # it may have sized its pool from the server's environment.
        try:
            torch.set_num_threads(int(threads))
        except Exception:  # noqa: BLE001
            pass


def run_rank(spec, fds: dict, expected_ppid: int, forked_from_launcher: bool = False):
    """Run one rank in this (new) process. Never returns."""
    code = EXIT_ERROR
    try:
        terminal = spec.terminal or {}
        _take_over_process(fds, expected_ppid, terminal,
                           unbuffered=bool(spec.env.get("PYTHONUNBUFFERED")))
        if spec.serve:
            heal.block_release()   # before _apply_spec starts any thread
        _apply_spec(spec, forked_from_launcher)
        code = _run_and_report(spec, fds)
    except _ChannelClosed as exc:
        code = EXIT_CHANNEL_CLOSED
        try:
            os.write(2, f"[mplaunch] rank {spec.rank}: {exc}\n".encode())
        except OSError:
            pass
    except BaseException:  # noqa: BLE001 - last resort: the parent sees the exit code
        try:
            import traceback
            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        procgroup.teardown(failed=code != 0)   # the outcome has been sent already
        _flush_streams()
        _run_multiprocessing_finalizers()
        _kill_descendants()
        os._exit(code)


def _run_multiprocessing_finalizers() -> None:
    # os._exit skips them, and the resource tracker that would clean up after them dies
    # with the rank's other children: the named semaphores of a spawn or forkserver
    # DataLoader's queues would stay in /dev/shm. Priority >= 0 only: those unlink and
    # terminate; the lower ones join queue feeder threads, which could wait forever.
    util = sys.modules.get("multiprocessing.util")
    if util is None:
        return
    try:
        util._run_finalizers(0)
    except BaseException:  # noqa: BLE001 - exiting anyway
        pass


def _kill_descendants() -> None:
    # What the function started and left running ends with the rank. Under a server
    # that would happen anyway (it is their subreaper); a fork-mode rank's leftovers in
    # a session of their own would otherwise outlive the launch.
    for pid in linux.descendants_of(os.getpid()):
        linux.kill_quiet(pid, signal.SIGKILL)


def _run_and_report(spec, fds: dict) -> int:
    import socket
    sock = socket.socket(fileno=fds["result"])
    global _channel_inode
    _channel_inode = os.fstat(sock.fileno()).st_ino
    debugging.install(sock, spec.rank, spec.serve)   # pdb, input() ask the launcher
    flight.arm()   # before any process group: a ring buffer cheap to read
    if spec.serve:
        heal.arm_release()   # before the first call: every thread must inherit its mask
        serving.arm()        # the World's interrupt: only inside a call's window
    code = _call_and_report(sock, spec, fds["payload"], first=True)
    if spec.serve:
        # A World's rank: more calls follow, until the parent ends the world.
        return serving.serve(sock, fds["payload"],
                             lambda fd, changes: _call_and_report(sock, spec, fd, changes))
    return code


def _call_and_report(sock, spec, payload_fd: int, changes=(), first: bool = False) -> int:
    """Run what the payload in `payload_fd` holds (or the spec's script), after the
    caller's module `changes` (_rank.reloads); send one message: the result or the
    exception; the exit code that calls for. The payload stays open (the rank's spawn and
    forkserver children read its __main__ there); its large buffers are mapped, not read."""
    payload, inputs = buffers.read_payload(payload_fd)
    # A World's rank: what tells its exception from the World's ending of the call.
    began = heal.call_begins() if spec.serve else None
    exitcode = 0
    try:
        if first:
            # Once: a World's group that a call destroyed stays destroyed (re-making it
            # would rendezvous again under the same keys).
            procgroup.setup(spec.backend)
        if spec.script is not None:
            serving.accept_interrupts(True)
            value = _run_script(spec.script.target, spec.script.kind)
        else:
            if changes:   # before the load, and said even if the load then fails
                _send(sock, KeptGlobals(tuple(reloads.follow(changes))))
            func, args, kwargs = wire_payload.loads_payload(
                payload, mainmod.publish(payload_fd), inputs)
            del payload, inputs
            if (notes := mainglobals.take_kept()):
                _send(sock, KeptGlobals(tuple(notes)))   # the caller warns
            # The World's interrupt may end the call's own code, never mplaunch's
            # calls of a heal (the group's state, its rebuild) nor their set-up.
            serving.accept_interrupts(not serving.own_call(func))
            debugging.call_begins(func)   # the user's calls forget the last error
            own = serving.own_call(func)
            if not own:
                flight.call_begins()
            try:
                value = func(*args, **kwargs)
            finally:
                serving.accept_interrupts(False)
                debugging.call_ends()
                if taken := flight.take(own):
                    _send(sock, taken)
                mainglobals.settle(func)   # what the call assigned is the rank's
    except SystemExit as exc:
        serving.accept_interrupts(False)
        exitcode = _exit_code(exc.code)
        if exitcode == 0:
            _send(sock, Returned(None))
            return 0
        if not spec.serve:
            procgroup.shield()
        _send_exception(sock, exc, exitcode, show=False)  # as python does for exit(n)
        return exitcode
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt and pytest outcomes too
        serving.accept_interrupts(False)
        show = debugging.on_error(exc)
        if not spec.serve:
            procgroup.shield()   # its group ends after the report, before the SIGTERM
        _send_exception(sock, exc, EXIT_ERROR, show, hint=_spawn_style_hint(exc),
                        rank=debugging.rank(), began=began)
        return EXIT_ERROR
    serving.accept_interrupts(False)   # a script's call: its value is being answered
    try:
        data, tensor_fds = wire_payload.dumps_result(value)
    except BaseException as exc:  # noqa: BLE001
        err = TypeError(f"rank {debugging.rank()} returned a value that could not be pickled "
                        f"({type(value).__name__}): {type(exc).__name__}: {exc}. Return "
                        "something picklable, or save it to a file and return the path.")
        err.__cause__ = exc
        if spec.script is None:
            err = _raised_at_return(func, err)
        if not spec.serve:
            procgroup.shield()
        _send_exception(sock, err, EXIT_ERROR)
        return EXIT_ERROR
    _send_raw(sock, RESULT_TAG + data, tensor_fds)
    for fd in tensor_fds:
        os.close(fd)
    return exitcode


def _raised_at_return(func, err: BaseException) -> BaseException:
    """`err` with a traceback frame at `func`'s return statement: the pickling failed
    inside cloudpickle, but the line to look at is the one that returned the value
    (its def line when there are several returns)."""
    code = getattr(func, "__code__", None)
    if code is None:
        return err
    import dis
    import linecache
    lines = {i.positions.lineno for i in dis.get_instructions(code)
             if i.opname.startswith("RETURN") and i.positions.lineno}
    lines = {n for n in lines
             if linecache.getline(code.co_filename, n).lstrip().startswith("return")}
    line = lines.pop() if len(lines) == 1 else code.co_firstlineno

    def _raise(e):
        raise e

    at = _raise.__code__.replace(co_filename=code.co_filename, co_name=code.co_name,
                                 co_firstlineno=line - 1)
    try:
        type(_raise)(at, {})(err)
    except BaseException as raised:  # noqa: BLE001
        return raised
    return err


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)  # sys.exit("message") prints it and exits 1
    return 1


def _send(sock, msg) -> None:
    import pickle
    _send_raw(sock, MESSAGE_TAG + pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), ())


_channel_inode = None


def _check_channel(sock) -> None:
    try:
        intact = os.fstat(sock.fileno()).st_ino == _channel_inode
    except OSError:
        intact = False
    if not intact:
        raise _ChannelClosed(
            f"its result channel (fd {sock.fileno()}) was closed before it returned, so "
            "its result or error cannot reach mplaunch (did it close file descriptors "
            "it did not open, e.g. os.closerange(3, ...)?)")


def _send_raw(sock, data: bytes, fds) -> None:
    # What the call printed reaches the pipes before its answer reaches the parent: a
    # World's run ends with all of its own output (a last line without its newline too).
    _flush_streams()
    _check_channel(sock)
    try:
        send_framed(sock, data, fds)
    except OSError:
        pass  # the parent is gone; the death signal will end us


_SPAWN_HINT = (
    "[mplaunch] the function is called with args and kwargs only: unlike "
    "torch.multiprocessing.spawn, mplaunch passes no rank argument. Read the rank from "
    "the RANK environment variable (LOCAL_RANK on this node), or call "
    "torch.distributed.get_rank() after init_process_group().")


def _spawn_style_hint(exc: BaseException):
    """The hint for a function written for torch.multiprocessing.spawn, fn(rank, ...):
    only for a missing argument of the call to the function itself. No frame below ours
    means the call failed while binding its arguments, before the function ran; a
    TypeError from deeper inside is the user's own."""
    tb = exc.__traceback__
    if (type(exc) is TypeError and tb is not None and tb.tb_next is None
            and tb.tb_frame.f_code is _call_and_report.__code__
            and "required positional argument" in str(exc)):
        return _SPAWN_HINT
    return None


def _from_users_code(exc: BaseException) -> None:
    """Cut the frames above the user's code off `exc` and off every exception of its
    chain, as pytest leaves out its own frames above a test: the rank's stderr, the
    error's ``traceback`` text and its ``__cause__`` then start at the user's first
    frame, whichever front-end called it. Frames below the user's (an mplaunch function
    the user called) are the user's business and stay. A traceback with no frame of
    the user's keeps all but this module's."""
    pending, seen = [exc], set()
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        tb = first = exc.__traceback__
        while first is not None and is_ours(first):
            first = first.tb_next
        if first is None:
            while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
                tb = tb.tb_next
            first = tb
        exc.__traceback__ = first
        pending += [exc.__cause__, exc.__context__]


def _send_exception(sock, exc: BaseException, exitcode: int, show: bool = True,
                    hint=None, rank=None, began=None) -> None:
    """Send `exc` as the call's answer, its traceback written to stderr first (`show`).
    `began`: a World's rank's call_begins() of this call (_rank.heal): an exception that
    the World's release or interrupt raised is one line there, not a traceback."""
    serving.accept_interrupts(False)   # the World's interrupt must not cut the answer off
    _from_users_code(exc)
    released = heal.ended_by_world(exc, began) if began is not None else None
    if show and released is None and cells.raised_by_cell(exc):
        show = False   # a %%ranks cell's error: the notebook shows it, once
    if hint:
        # A note on the cause (Python shows it under the exception from 3.11 on), and
        # a line of the message, so str(WorkerError) says it under every Python.
        exc.__notes__ = [*getattr(exc, "__notes__", ()), hint]
    blob, type_name, message, tb_text = pack_exception(exc)
    if hint:
        message = f"{message}\n{hint}"
    if show:
        # The copy on stderr goes first: once the exception is sent, the parent may
        # tear this rank down before it is written. But stderr may be unusable (None
        # in daemonised code, fd 2 closed): nothing here may stop the sending.
        try:
            sys.stderr.write(tb_text if released is None
                             else heal.released_line(rank, released, tb_text))
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001 - the exception itself is sent below
            pass
    _send(sock, Raised(blob, type_name, message, tb_text, exitcode, time.time(),
                       released))


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    try:
        # C stdio (printf from extensions) buffers too, and os._exit does not flush it.
        linux._c().fflush(None)
    except BaseException:  # noqa: BLE001
        pass


def _run_script(target: str, kind: str):
    """Run a script (kind 'path') or module (kind 'module') as __main__, as `python
    script.py` would."""
    import runpy
    from .script_main import guard_script_children
    guard_script_children()   # its DataLoader workers must not run it again
    if kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
    return None


# -- exec'd ranks (start_method="spawn") -----------------------------------------------

def exec_main() -> None:
    """Entry point of a rank started as a fresh interpreter."""
    import pickle
    spec_fd = int(sys.argv[1])
    start = pickle.loads(linux.read_all_fd(spec_fd))   # an ExecRank (_wire.messages)
    os.close(spec_fd)
    sys.argv[:] = [sys.argv[0]]
    run_rank(start.spec, start.fds, start.parent)

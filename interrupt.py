# Ctrl-C (SIGINT) in the command lines: one line on stderr and exit status 130 (128 + SIGINT, what a shell reports for
# it), never a traceback, wherever it lands: the imports, loading, compiling, generating. Every CLI imports this module
# before anything else, because torch's import alone takes seconds and an interrupt there never reaches main; past the
# imports tp.exit_with(main), every CLI's entry, calls leave(). generate.py --interactive catches KeyboardInterrupt
# itself during an answer, which stops that answer only; loading weights holds Ctrl-C until safetensors returns (held),
# where it would come out as a damaged file. An output that can no longer be written ends a command the same way
# (leave_without_stdout): quietly when its reader went away (`| head`), else in one line. Standard library only: it
# must load before torch.
import contextlib
import os
import signal
import sys
import threading

STATUS = 130
LINE = "interrupted"
PIPE_STATUS = 141  # 128 + SIGPIPE: what a shell reports for a command whose reader went away, as `yes | head` does


def leave(status: int = STATUS, line: str = LINE):
    """Ends the process after Ctrl-C (or as leave_without_stdout says): what was printed is flushed, then the one line
    and status 130. os._exit: the interpreter's teardown (atexit, torch's finalisers) could be interrupted again, each
    time with a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while leaving changes nothing
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed, or None
            pass
    try:
        os.write(2, f"{line}\n".encode() if line else b"")
    except OSError:
        pass
    os._exit(status)


class WatchedStdout:
    """sys.stdout while a command's main runs (tp.exit_with): writes and flushes go to the stream it wraps, and the
    OSError one of them raised is kept, so that stdout_failed tells stdout's errors from any other (flushing again
    cannot: a write that fails unbuffered, as under PYTHONUNBUFFERED, leaves nothing behind to try again)."""

    def __init__(self, stream):
        self.stream, self.error = stream, None

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        try:
            return self.stream.flush()
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name):
        return getattr(self.stream, name)


def watch_stdout():
    """sys.stdout becomes a WatchedStdout of itself (once)."""
    if sys.stdout is not None and not isinstance(sys.stdout, WatchedStdout):
        sys.stdout = WatchedStdout(sys.stdout)


def stdout_failed(error: BaseException):
    """stdout's OSError if error is it or was raised while handling it (a write or flush of the watched stdout
    failed), else None."""
    failed = getattr(sys.stdout, "error", None) if isinstance(sys.stdout, WatchedStdout) else None
    seen = set()
    while failed is not None and error is not None and id(error) not in seen:
        if error is failed:
            return failed
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def leave_without_stdout(error: OSError):
    """Ends the process once stdout cannot be written: quietly with status 141 when its reader went away (a broken
    pipe), else (a full disk, /dev/full) one error line and status 1. What stdout still holds goes to os.devnull,
    so no flush on the way out fails again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    if isinstance(error, BrokenPipeError):
        leave(PIPE_STATUS, "")
    leave(1, f"error: cannot write the output: {error.strerror or error}")


@contextlib.contextmanager
def held():
    """Ctrl-C inside the block is held until the block ends, then raised as KeyboardInterrupt. Around calls into
    extensions that run Python inside them: safetensors' loop makes each tensor through torch, and a KeyboardInterrupt
    raised in there comes out as torch's ValueError ("could not determine the shape of object type ..."), which
    loading would report as a damaged file. Holds only Python's own handler, on the main thread (the one that runs
    signal handlers); anywhere else the block runs as it is."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if caught:
            raise KeyboardInterrupt


def _excepthook(kind, value, tb, previous=sys.excepthook):
    # Only where a script runs: the REPL reports a KeyboardInterrupt through sys.excepthook and must keep it.
    if issubclass(kind, KeyboardInterrupt) and getattr(sys.modules.get("__main__"), "__file__", None):
        leave()
    previous(kind, value, tb)


sys.excepthook = _excepthook

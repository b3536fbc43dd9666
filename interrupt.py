# Ctrl-C (SIGINT) in the command lines: one line on stderr and exit status 130 (128 + SIGINT, what a shell reports for
# it), never a traceback, wherever it lands: the imports, loading, compiling, generating. Every CLI imports this module
# before anything else, because torch's import alone takes seconds and an interrupt there never reaches main; past the
# imports tp.exit_with(main), every CLI's entry, calls leave(). generate.py --interactive catches KeyboardInterrupt
# itself during an answer, which stops that answer only. Standard library only: it must load before torch.
import os
import signal
import sys

STATUS = 130
LINE = "interrupted"


def leave():
    """Ends the process after Ctrl-C: what was printed is flushed, then the one line and status 130. os._exit: the
    interpreter's teardown (atexit, torch's finalisers) could be interrupted again, each time with a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while leaving changes nothing
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed, or None
            pass
    try:
        os.write(2, f"{LINE}\n".encode())
    except OSError:
        pass
    os._exit(STATUS)


def _excepthook(kind, value, tb, previous=sys.excepthook):
    # Only where a script runs: the REPL reports a KeyboardInterrupt through sys.excepthook and must keep it.
    if issubclass(kind, KeyboardInterrupt) and getattr(sys.modules.get("__main__"), "__file__", None):
        leave()
    previous(kind, value, tb)


sys.excepthook = _excepthook

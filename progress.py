# A line every few seconds while a long step runs (compiling a step, timing passes, building kernels), so a terminal
# is never silent for long; a step done sooner says nothing more.
import contextlib
import threading
import time

EVERY = 5.0  # seconds between lines: half of the longest silence allowed, leaving room for the untimed work between steps


@contextlib.contextmanager
def ticking(what: str, log, every: float = EVERY):
    """Calls log(f"  {what}: N s ...") every `every` seconds until the block ends (from a daemon thread: Python
    code and compilers both leave it its turn)."""
    done, start = threading.Event(), time.perf_counter()

    def tick():
        while not done.wait(every):
            log(f"  {what}: {time.perf_counter() - start:.0f} s ...")

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()

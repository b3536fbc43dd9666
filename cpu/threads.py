# The threads a CPU's steps run on: as many as the cores other processes leave free, read again every tenth of a second
# while an answer runs. A step is a few hundred parallel regions (each linear, attention, the compiled kernels), and
# each ends at a barrier that waits for every thread: when another process holds a core, the thread that shares it
# is descheduled for a time slice at a time, and every region waits for it. One thread then decodes several times
# faster than two (docs/cpu.md, "Threads under load"). Inductor's kernels and eaglet's read the thread count when they
# run, so a step compiled for two threads runs on one unchanged.
import contextlib
import os
import time

import torch

PERIOD = 0.1  # seconds between two readings of the machine's load (/proc counts in hundredths)
SPARE = 0.5  # a core is free when other processes use less than half of it


def cpu_ticks(cpus) -> int:
    """Busy clock ticks (all but idle and iowait) of these CPUs since boot, from /proc/stat."""
    names, busy = {f"cpu{c}" for c in cpus}, 0
    with open("/proc/stat") as f:
        for line in f:
            name, *ticks = line.split()
            if name in names:
                ticks = list(map(int, ticks[:8]))
                busy += sum(ticks) - ticks[3] - ticks[4]
    return busy


def stat_fields(pid) -> list:
    """/proc/PID/stat's fields after the command's name: [0] state, [1] ppid, [11:15] utime stime cutime cstime."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def own_ticks() -> int:
    """Clock ticks this process has run (user and system, every thread), from /proc/self/stat."""
    fields = stat_fields("self")
    return int(fields[11]) + int(fields[12])


def tree_ticks() -> int:
    """Clock ticks this process and every process it started have run, those that ended included (their parents
    count them once they are reaped): a measurement's compiler and timing processes are its own work, not load."""
    parents, ticks = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = stat_fields(pid)
        except OSError:  # ended while listed
            continue
        parents[int(pid)], ticks[int(pid)] = int(fields[1]), sum(map(int, fields[11:15]))
    mine, total = os.getpid(), 0
    for pid, tick in ticks.items():
        p = pid
        while p > 1 and p != mine:
            p = parents.get(p, 0)
        total += tick if p == mine else 0
    return total


def threads_for(cores: int, others: float, most: int) -> int:
    """Threads for a process that may use `cores` CPUs of which other processes keep `others` busy (in cores)."""
    return max(1, min(most, int(cores - others + SPARE)))


class Pace:
    """Called between steps: sets torch's thread count for the load the machine is under (threads_for), from what
    /proc says the other processes used since the last reading (the first one is taken at import, so the first answer
    decides from the load during loading). Between answers the caller's own count comes back, so that what compiles,
    and the keys of what it saved, never depend on a moment's load."""

    def __init__(self):
        self.cpus = sorted(os.sched_getaffinity(0))
        self.hz = os.sysconf("SC_CLK_TCK")
        self.mark, self.free = self.reading(), len(self.cpus)
        self.most = torch.get_num_threads()

    def reading(self) -> tuple:
        return time.monotonic(), cpu_ticks(self.cpus), own_ticks()

    def __call__(self):
        if time.monotonic() - self.mark[0] >= PERIOD:
            new = self.reading()
            self.free = threads_for(len(self.cpus), self.others(self.mark, new), len(self.cpus))
            self.mark = new
        threads = min(self.free, self.most)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def others(self, before: tuple, after: tuple) -> float:
        """Cores other processes kept busy between two readings."""
        (t0, busy0, own0), (t1, busy1, own1) = before, after
        return max(0, (busy1 - busy0) - (own1 - own0)) / self.hz / max(t1 - t0, 1e-3)


_pace = Pace() if os.path.exists("/proc/stat") and os.path.exists("/proc/self/stat") else None


@contextlib.contextmanager
def pacing():
    """ops.pacing on a CPU: the process's Pace between steps, the caller's thread count put back after."""
    most = torch.get_num_threads()
    if _pace is None or most == 1:
        yield lambda: None
        return
    _pace.most = most
    try:
        yield _pace
    finally:
        torch.set_num_threads(most)


def watch_load():
    """ops.watch_load on a CPU: whether, since this call, other processes took cores this process's threads needed
    (threads_for would have cut them). What this process started (compilers, a timing child) is its own."""
    if _pace is None:
        return lambda: None
    reading = lambda: (time.monotonic(), cpu_ticks(_pace.cpus), tree_ticks())  # noqa: E731
    start, threads = reading(), torch.get_num_threads()

    def disturbed():
        others = _pace.others(start, reading())
        if threads_for(len(_pace.cpus), others, threads) < threads:
            return f"other processes kept {others:.1f} of its {len(_pace.cpus)} cores busy"
        return None
    return disturbed

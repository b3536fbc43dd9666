# The threads a CPU's steps run on under load (cpu/threads.py): as many as the cores other processes leave free, the
# caller's count put back between answers.
import torch

import ops
from cpu import threads


def test_threads_follow_the_cores_other_processes_leave_free():
    assert threads.threads_for(2, 0.0, 2) == 2
    assert threads.threads_for(2, 0.4, 2) == 2  # a browser's blips keep both
    assert threads.threads_for(2, 0.7, 2) == 1  # another process on a core: one thread
    assert threads.threads_for(2, 2.0, 2) == 1  # never none
    assert threads.threads_for(8, 1.0, 8) == 7 and threads.threads_for(8, 1.0, 4) == 4  # never more than asked


def test_pace_reads_the_load_of_other_processes_alone_and_puts_the_count_back(monkeypatch):
    """Busy ticks of the process itself are not load: a run on two threads that fills both cores keeps two; another
    process that fills a core while it runs sends it to one; when that process ends it goes back to two. After the
    answer (the pacing block) the caller's own count is back. A Pace that counted its own ticks as load, or left its
    count set, fails here."""
    clock, busy, own = [0.0], [0], [0]
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(threads, "cpu_ticks", lambda cpus: busy[0])
    monkeypatch.setattr(threads, "own_ticks", lambda: own[0])
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads.os, "sysconf", lambda name: 100)
    monkeypatch.setattr(threads, "_pace", threads.Pace())
    before = torch.get_num_threads()
    seen = []

    def tick(others: float, ours: float, seconds: float = 0.25):  # a while in which these cores were busy
        clock[0] += seconds
        busy[0] += round(100 * seconds * (others + ours))
        own[0] += round(100 * seconds * ours)

    try:
        torch.set_num_threads(2)
        with ops.pacing(torch.device("cpu")) as pace:
            for others, ours in [(0.0, 2.0), (0.0, 2.0), (0.8, 1.2), (1.0, 1.0), (0.1, 1.0), (0.0, 2.0)]:
                tick(others, ours)
                pace()
                seen.append(torch.get_num_threads())
        assert seen == [2, 2, 1, 1, 2, 2]
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)  # a caller on one thread is left alone
        with ops.pacing(torch.device("cpu")) as pace:
            tick(0.0, 1.0)
            pace()
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_what_this_process_started_is_its_own_work_and_another_process_is_load(monkeypatch):
    """tree_ticks counts a child this process started (a compiler, a timing child), so a measurement that starts one
    is not disturbed by it; a process it did not start that holds a core while a two-thread measurement runs is
    load (watch_load says so)."""
    import subprocess
    import sys
    import time

    before = threads.tree_ticks()
    # Half a second of the child's own CPU time, however loaded the machine (a wall-clock half second may get less).
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile time.process_time() < 0.5: pass"])
    child.wait()
    assert threads.tree_ticks() - before >= 30  # the child's half second, once reaped (a tick is 1/100 s)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        time.sleep(0.3)  # started and spinning
        monkeypatch.setattr(threads, "tree_ticks", threads.own_ticks)  # as if the hog were not ours
        monkeypatch.setattr(torch, "get_num_threads", lambda: len(threads.os.sched_getaffinity(0)))
        disturbed = threads.watch_load()
        time.sleep(0.5)
        assert disturbed() and "cores busy" in disturbed()
    finally:
        hog.kill()
        hog.wait()


def test_a_disturbed_measurement_serves_the_run_and_is_not_kept(tmp_path, monkeypatch, capsys):
    import cachedir

    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path))
    cachedir.store("m.json", "k", {"x": 1}, "other processes kept 1.0 of its 2 cores busy")
    assert not (tmp_path / "m.json").exists() and "measured again next run" in capsys.readouterr().err
    cachedir.store("m.json", "k", {"x": 1}, None)
    assert cachedir.read("m.json") == {"k": {"x": 1}}

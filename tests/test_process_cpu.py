"""The benchmarks' CPU sampler: each process's CPU seconds between two wall-clock times."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from benchmarks.process_cpu import CpuTimeline

BURN = "import time\nstart = time.process_time()\nwhile time.process_time() - start < 0.4: pass\n"


def test_cpu_of_a_child_is_counted_in_the_window_it_used_it() -> None:
    with CpuTimeline(interval_s=0.02, list_every_s=0.02) as cpu:
        time.sleep(0.1)
        before = time.time()
        child = subprocess.Popen([sys.executable, "-c", BURN + "time.sleep(0.3)"])
        time.sleep(0.1)  # sampled while it burns
        child.wait()
        after = time.time()
        time.sleep(0.1)
    burned = cpu.used_between(before, after)[child.pid]
    assert 0.3 <= burned <= 0.8  # its 0.4 s of burning and its interpreter's start
    assert "python" in cpu.labels[child.pid] and "-c" in cpu.labels[child.pid]
    assert cpu.used_between(after, time.time()).get(child.pid, 0.0) == 0.0  # ended: no more
    assert cpu.used_between(0.0, before).get(child.pid, 0.0) == 0.0  # not started yet


def test_sampling_ends_with_the_first_sample_once_until_held() -> None:
    done = threading.Event()
    with CpuTimeline(interval_s=0.02, until=done.is_set) as cpu:
        time.sleep(0.1)
        done.set()
        time.sleep(0.2)  # one more sample, then none
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
        time.sleep(0.2)
        child.wait()
    assert "this process" in cpu.labels.values()
    assert child.pid not in cpu.labels  # started after sampling ended


def test_processes_are_found_every_list_interval_and_counted_from_their_start() -> None:
    listings = []

    def extra() -> list:
        listings.append(time.monotonic())
        return []

    with CpuTimeline(extra=extra, interval_s=0.02, list_every_s=0.6) as cpu:
        started = time.time()
        child = subprocess.Popen([sys.executable, "-c", BURN + "time.sleep(1.0)"])
        time.sleep(1.3)  # found at the second listing, 0.6 s in, after it burned
        found_at = time.time()
        child.wait()
    assert 2 <= len(listings) <= 4  # at 0, 0.6 and 1.2 s: not at every sample (about 65)
    burned = cpu.used_between(started, found_at)[child.pid]
    assert 0.3 <= burned <= 0.8  # the burning it did before it was found counts

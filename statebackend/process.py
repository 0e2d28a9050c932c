"""Process-wide settings a task applies to the Python process it runs in."""

from __future__ import annotations

import sys

__all__ = ["shorten_thread_switch_interval"]


def shorten_thread_switch_interval(microseconds: int) -> None:
    """Lower the process's GIL switch interval to ``microseconds`` (0, or an interval already shorter: unchanged).

    A task's background threads (commit uploads and checkpoint writes, the appliers, a parked task's handover) make
    many short system calls beside CPU-bound processing on the task thread. Python's default interval (5 ms) is how
    long a thread coming back from a system call may wait for the GIL while another thread runs Python: with CPU-bound
    processing beside it, a durable commit's few dozen calls each waited up to that (``python -m bench.contention``:
    durable p50 216 ms at 5 ms, 31 ms at 200 us, 7 ms with no thread beside it; a handover's close 16.1 ms
    against 1.3 ms). The setting is process-wide and only ever lowered."""
    if microseconds <= 0:
        return
    wanted = microseconds / 1_000_000
    if sys.getswitchinterval() > wanted:
        sys.setswitchinterval(wanted)

"""The thread a host step runs on beside the training thread: the overlapped step (overlapped_step.py) and the
delayed update (delayed_update.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def use_threads(count: int) -> None:
    """This thread's torch CPU kernels use ``count`` threads (torch reads the count once per thread, first)."""
    torch.get_num_threads()
    torch.set_num_threads(count)


def step_thread_count(threads: int) -> int:
    """The torch CPU threads of a host step's thread beside a training thread of ``threads``."""
    return max(1, threads - 1)


def host_step_pool(name: str) -> ThreadPoolExecutor:
    """One worker thread whose torch CPU kernels use one thread fewer than the training thread's. torch's CPU
    kernels split their work evenly over their threads, so one of them sharing a core with the training thread
    (busy launching the forward's kernels, or spinning in a CUDA synchronise) would hold up the whole step, each
    chunk of it."""
    threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=use_threads,
                              initargs=(step_thread_count(threads),))
    pool.submit(lambda: None).result()  # the thread has set its own count: now put back torch's process-wide
    torch.set_num_threads(threads)  # default, which setting a count also changes
    return pool

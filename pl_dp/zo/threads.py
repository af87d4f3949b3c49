"""Independent pieces of work on all CPU cores, and the per-thread state they draw with.

torch's CPU generator fills a tensor on one thread (``normal_`` holds the generator's lock for the
whole fill), so a direction drawn with one generator uses one core however many there are. The
engine cuts a direction into fixed-size chunks, each with its own seed, and :func:`run_all` hands
the chunks to ``torch.get_num_threads()`` threads: the calling thread plus a shared
:class:`~concurrent.futures.ThreadPoolExecutor`. torch releases the GIL inside its operators, so
the threads draw and add in parallel; what each chunk computes never depends on which thread runs
it or how many there are.

Each thread keeps its own generator per device (:func:`generator`): generators are not safe to
share between threads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

Item = TypeVar("Item")

_state = threading.local()
_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (process id, workers, executor)
_pool_lock = threading.Lock()


def _executor(workers: int) -> ThreadPoolExecutor:
    """The shared pool with ``workers`` threads (rebuilt after a fork or a change of thread count)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[:2] != (os.getpid(), workers):
            if _pool is not None and _pool[0] == os.getpid():
                _pool[2].shutdown(wait=False)
            _pool = (os.getpid(), workers, ThreadPoolExecutor(workers, thread_name_prefix="pl_dp-zo"))
        return _pool[2]


def run_all(work: Callable[[Item], None], items: Sequence[Item], parallel: bool = True) -> None:
    """``work(item)`` for every item, on up to ``torch.get_num_threads()`` threads when ``parallel``.

    The calling thread takes part; items are handed out one at a time as threads free up (so a
    thread slowed by other processes takes fewer), under the caller's grad mode (thread-local in
    torch). ``work`` must touch disjoint memory for distinct items. The first exception stops the
    hand-out and is raised here once every thread has stopped.
    """
    threads = min(torch.get_num_threads(), len(items)) if parallel else 1
    if threads <= 1:
        for item in items:
            work(item)
        return
    pending = iter(items)
    lock = threading.Lock()
    failed: list[BaseException] = []

    grad_enabled = torch.is_grad_enabled()

    def drain() -> None:
        with torch.set_grad_enabled(grad_enabled):
            take_all()

    def take_all() -> None:
        while not failed:
            with lock:
                try:
                    item = next(pending)
                except StopIteration:
                    return
            try:
                work(item)
            except BaseException as error:  # noqa: BLE001 — re-raised in the calling thread below
                failed.append(error)

    futures = [_executor(threads - 1).submit(drain) for _ in range(threads - 1)]
    take_all()
    for future in futures:
        future.result()
    if failed:
        raise failed[0]


def generator(device: torch.device) -> torch.Generator:
    """This thread's generator for ``device`` (re-seeded by the caller before every draw)."""
    generators = _state.__dict__.setdefault("generators", {})
    g = generators.get(device)
    if g is None:
        g = generators[device] = torch.Generator(device=device)
    return g

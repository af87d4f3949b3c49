"""Helpers of the multi-process tests."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int, work: Callable[[int, Any, dict], None], mesh_results: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))  # not 30 min
    torch.set_num_threads(1)
    try:
        work(rank, init_device_mesh("cpu", (2,)), mesh_results)
    finally:
        dist.destroy_process_group()


def on_two_ranks(work: Callable[[int, Any, dict], None]) -> dict:
    """Run ``work(rank, mesh, results)`` on 2 plain torch processes over gloo (a 1-D CPU mesh); what they put in
    ``results`` (a shared dict). ``work`` must be a module-level function (it is pickled to the processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(port, work, results), nprocs=2, join=True)
        return dict(results)

"""Local W&B runs read back from their ``.wandb`` logs, with no W&B account or server.

Every W&B run, online or offline, keeps its log in the local W&B directory; :func:`read_run` reads a run's config,
summary, history and group from it, and :func:`group_points` the (ε, test metric) points of a group's finished runs,
which :class:`~pl_dp.callbacks.WandbPrivacyLogger` charts at test end.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_BLOCK = 32768


def read_run(run_dir: str | Path) -> dict[str, Any]:
    """Config, summary, history and group of a local W&B run directory, read from its ``.wandb`` log.

    The log is LevelDB-framed: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of
    chunks with a 7-byte header (crc32, length, type: 1 full, 2/3/4 first/middle/last), each record a
    ``wandb_internal_pb2.Record``.
    """
    from wandb.proto import wandb_internal_pb2

    data = next(Path(run_dir).glob("*.wandb")).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{run_dir} holds no W&B run log.")
    out: dict[str, Any] = {"config": {}, "summary": {}, "history": [], "group": ""}

    def items(entries: Any) -> dict[str, Any]:
        return {e.key or "/".join(e.nested_key): json.loads(e.value_json) for e in entries}

    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # a run still being written: its last chunk is not complete yet
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind not in (1, 4):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        field = record.WhichOneof("record_type")
        if field == "run":  # wandb-core may fold (debounced) config updates into the run record
            out["group"] = record.run.run_group or out["group"]
            out["config"].update(items(record.run.config.update))
        elif field == "config":
            out["config"].update(items(record.config.update))
        elif field == "summary":
            out["summary"].update(items(record.summary.update))
        elif field == "history":
            out["history"].append(items(record.history.item))
    return out


def group_points(wandb_dir: str | Path, group: str, key: str = "summary/test_acc") -> list[tuple[float, float]]:
    """(ε, the summary's ``key``: test accuracy by default) of every finished local run of ``group`` under
    ``wandb_dir``."""
    points = []
    for run_dir in sorted(Path(wandb_dir).glob("*run-*")):
        try:
            run = read_run(run_dir)
        except (StopIteration, ValueError):
            continue
        summary = run["summary"]
        if run["group"] == group and "summary/epsilon" in summary and key in summary:
            points.append((float(summary["summary/epsilon"]), float(summary[key])))
    return points

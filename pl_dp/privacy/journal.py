"""A write-ahead journal of what a run released: the steps a checkpoint cannot see.

A checkpoint holds the accountant history up to its own step. Two things release more than that:

* a run that logs metrics after its last checkpoint and then dies: the resume repeats those steps
  with fresh noise, and the adversary holds the logged outputs of both the lost and the repeated
  steps;
* two resumes from one checkpoint (or a resume after a finished continuation): each releases its
  own continuation of the same data.

Under the threat model (the adversary sees every log and checkpoint) the privacy spent is the
composition of *every* step whose output left the process, in every branch. The journal records,
for each segment of a lineage (one fit of one process; a lineage is a run and all its resumes), the
accountant history of that segment's own steps, rewritten whenever something is about to leave the
process (a logged step, a checkpoint, the end of the fit) — before it does. A resumed run's
accountant is the composition of every segment in the journal, which includes everything the
checkpoint holds and everything released after it.

The journal holds accountant histories only (noise multipliers, sample rates, step counts): public
information, never a secret. It is a JSON-lines file with one line per record; a torn last line
(a crash mid-write) is ignored, and a segment's latest record supersedes its earlier ones. Writes
are flushed to the operating system, which survives the death of the process (the common crash);
an operating-system crash can lose the last record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pl_dp.privacy.accountants import Accountant, create_accountant, load_accountant


class PrivacyJournal:
    """The journal file of one lineage: ``<directory>/<lineage>.jsonl``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @classmethod
    def of(cls, directory: str | Path, lineage: str) -> PrivacyJournal:
        return cls(Path(directory) / f"{lineage}.jsonl")

    def record(self, segment: str, accountant: Accountant) -> None:
        """Append the history of ``segment``'s own steps (supersedes the segment's earlier records)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"segment": segment, "accountant": accountant.state_dict()})
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()

    def segments(self) -> dict[str, dict[str, Any]]:
        """The latest accountant state of every segment (empty when the file does not exist)."""
        if not self.path.exists():
            return {}
        latest: dict[str, dict[str, Any]] = {}
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a record torn by a crash mid-write
                continue
            latest[record["segment"]] = record["accountant"]
        return latest

    def composed(self, accountant: str) -> Accountant:
        """One ``accountant`` (a name) holding every segment's steps, composed (in the order segments first appear)."""
        total = create_accountant(accountant)
        for state in self.segments().values():
            total.compose(load_accountant(state))
        return total

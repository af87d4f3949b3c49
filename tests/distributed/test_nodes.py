"""Multi-node as a cluster launches it: 2 "nodes" of 1 process each on localhost, started the way torchrun or SLURM
start them (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, NODE_RANK, LOCAL_RANK set; one process per node), running
``Trainer(num_nodes=2, devices=1)``. They are one logical private run: the same ε and, with the same seeds, the
parameters of one process.
"""

import json
import socket
import sys
from pathlib import Path

import pytest
import torch

from tests import background
from tests.distributed import worker

# 2 processes started as a cluster starts them (~25 s): `make test-slow` runs it (CI runs both suites)
pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(out: Path) -> list[background.Command]:
    """The two "nodes", node 1 started first."""
    base = dict(
        PYTHONPATH=str(ROOT),
        PYTHONWARNINGS="ignore",
        WANDB_MODE="offline",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE="2",
        LOCAL_RANK="0",
    )
    command = [sys.executable, str(ROOT / "tests/distributed/worker.py"), "nodes", str(out)]
    return [background.Command(command, env=dict(base, NODE_RANK=str(r)), cwd=ROOT, timeout=300) for r in (1, 0)]


#: the two nodes' fits, started in the background when the session starts (tests/background.py)
NODES = background.job("nodes", _nodes)


@pytest.fixture(scope="module")
def runs():
    single = {name: worker.run_one(name, 1) for name in worker.NODE_METHODS}
    out, nodes = NODES.result()
    for node in nodes:
        assert node.returncode == 0, node.stdout[-2000:] + node.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return ranks, single


@pytest.mark.parametrize("name", worker.NODE_METHODS)
def test_two_nodes_are_one_logical_run(runs, name):
    (node0, node1), single = runs
    assert node0[name]["world_size"] == node1[name]["world_size"] == 2
    assert [node0[name]["sampler"], node1[name]["sampler"]] == [
        {"num_replicas": 2, "rank": 0},
        {"num_replicas": 2, "rank": 1},
    ]
    assert node0[name]["parameters"] == node1[name]["parameters"]  # identical replicas
    assert node0[name]["epsilon"] == single[name]["epsilon"]
    if name != "dpzero_rank_seeded":  # secrets from OS entropy: equal in law, not in value
        torch.testing.assert_close(
            torch.tensor(node0[name]["parameters"]), torch.tensor(single[name]["parameters"]), rtol=0, atol=1e-6
        )

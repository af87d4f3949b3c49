"""What LayerScale's raw parameters cost a ghost-clipping or book-keeping step (issue 39 of [fast]).

    python benchmarks/layer_scale.py                 # ~2 minutes on 2 CPU cores, one torch thread
    python benchmarks/layer_scale.py --quick         # small sizes, smoke test
    python benchmarks/layer_scale.py --json benchmarks/results/layer_scale.json

A tiny ViT-like stack of residual MLP blocks on ``[B, T, d]`` tokens, ``x + gamma * mlp(norm(x))``, with ``gamma`` a
raw ``nn.Parameter`` of each block (LayerScale, Touvron et al. 2021) against the same stack with ``gamma`` a fixed
buffer (no raw parameter): the difference is what :mod:`pl_dp.per_sample.raw` adds — per block, the gradient at
the product ``gamma * h`` times h, summed per example (B·T·d work), and the graph walks that find the products and
check that every use of ``gamma`` passes through one. For each batch size the engines (``ghost``, ``bk``) and a
non-private forward and backward of the summed loss run on the same batch, interleaved round by round after a
warm-up round; medians are reported with the ratio of with to without LayerScale.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pl_dp.per_sample import BookKeeping, GhostClipping  # noqa: E402
from pl_dp.privacy import ClipFunction  # noqa: E402
from pl_dp.step.losses import cross_entropy  # noqa: E402


class Block(nn.Module):
    """``x + gamma * fc2(gelu(fc1(norm(x))))``; ``gamma`` a raw parameter (LayerScale) or a fixed buffer."""

    def __init__(self, width: int, layer_scale: bool) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        gamma = torch.full((width,), 0.1)
        if layer_scale:
            self.gamma = nn.Parameter(gamma)
        else:
            self.register_buffer("gamma", gamma)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int, depth: int, layer_scale: bool, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width, layer_scale) for _ in range(depth)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(1))


def _non_private(net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    grads = torch.autograd.grad(cross_entropy(net, batch).sum(), [p for p in net.parameters() if p.requires_grad])
    del grads


def measure(batch_size: int, tokens: int, width: int, depth: int, rounds: int) -> dict:
    torch.manual_seed(0)
    x, y = torch.randn(batch_size, tokens, width), torch.randint(0, 10, (batch_size,))
    fn = ClipFunction("constant", 1.0)
    runs = {}
    for layer_scale in (False, True):
        net = Net(width, depth, layer_scale)
        tag = "layer_scale" if layer_scale else "plain"
        runs[f"non_private/{tag}"] = lambda net=net: _non_private(net, (x, y))
        for name, engine in (("ghost", GhostClipping), ("bk", BookKeeping)):
            clipping = engine(copy.deepcopy(net), cross_entropy)  # one engine's hooks per net
            runs[f"{name}/{tag}"] = lambda clipping=clipping: clipping.clipped_sum((x, y), fn)
    times: dict[str, list[float]] = {key: [] for key in runs}
    for round_ in range(rounds + 1):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            if round_:  # the first round warms up
                times[key].append(time.perf_counter() - start)
    medians = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    result = {"batch": batch_size, "tokens": tokens, "width": width, "depth": depth, "median_ms": medians}
    result["layer_scale_over_plain"] = {
        name: medians[f"{name}/layer_scale"] / medians[f"{name}/plain"] for name in ("non_private", "ghost", "bk")
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [(8, 8, 32, 2)] if args.quick else [(16, 16, 64, 4), (64, 16, 64, 4), (64, 64, 128, 4)]
    rounds = 3 if args.quick else 11
    results = []
    for batch_size, tokens, width, depth in sizes:
        result = measure(batch_size, tokens, width, depth, rounds)
        results.append(result)
        ms = result["median_ms"]
        print(f"B={batch_size} T={tokens} d={width} depth={depth}")
        for name in ("non_private", "ghost", "bk"):
            print(
                f"  {name:12s} plain {ms[f'{name}/plain']:8.2f} ms   layer-scale {ms[f'{name}/layer_scale']:8.2f} ms"
                f"   x{result['layer_scale_over_plain'][name]:.2f}"
            )
    payload = {"torch": torch.__version__, "threads": args.threads, "rounds": rounds, "results": results}
    if args.json:
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()

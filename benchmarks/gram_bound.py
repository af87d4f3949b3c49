"""What float64 Gram norms with a rounding bound cost: how far they move the norms, and the time they take.

    python benchmarks/gram_bound.py                 # ~3 minutes on 2 CPU cores
    python benchmarks/gram_bound.py --quick         # small sizes, smoke test
    python benchmarks/gram_bound.py --json benchmarks/results/gram_bound.json

``"ghost"`` and ``"bk"`` measure a linear layer on ``[B, T, d]`` inputs (where 2T² ≤ p·d) and a tied weight by T×T
Gram matrices, now in float64 and raised by a bound E on their rounding (``pl_dp.per_sample.gram``); until this
change, in fp32 with nothing added (the formula Opacus uses), which an example whose positions nearly cancel could
round to 0. For the cases of ``benchmarks/ghost_first_pass.py`` (the transformer, the packaged pretrained MiniLM,
tiny GPT-2 and Llama with tied embeddings), on one batch:

* ``E/Ŝ``: the bound over the estimate, for every example at every Gram-measured linear layer call (median,
  largest);
* ``norm moved``: each example's whole-gradient norm over the one with the fp32 linear-layer norms, minus 1
  (largest in magnitude): how much harder (or, by fp32 rounding, softer) an example is clipped;
* ``M/‖g‖``: the largest ratio of an example's positions' mass M = Σ_t |b_t||a_t| to its norm, over every linear
  layer, bias, embedding and tied weight measured on sequences; ``floored``: how many of those norms the floor
  ``M·2⁻¹⁰`` raised (it binds where M/‖g‖ > 2¹⁰), out of how many;
* time: book-keeping's clipped sum as it is and with the fp32 linear-layer norms (``fp32``), interleaved round by
  round after a warm-up, medians, and a non-private forward + backward for reference. Tied weights are measured in
  float64 in both (their share of the time is small next to the linear layers').
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ghost_first_pass import _loss_of, _write, make_case  # noqa: E402

from pl_dp.per_sample import BookKeeping, gram  # noqa: E402
from pl_dp.privacy import ClipFunction  # noqa: E402

CLIP = ClipFunction("constant", 1.0)


def _fp32_linear_norms(layer, activations, backprops):
    """The linear-layer norm before float64: the same, with fp32 Gram matrices and no bound."""
    b = backprops.reshape(backprops.shape[0], -1, backprops.shape[-1])
    if backprops.dim() <= 2 or not layer.weight.requires_grad or 2 * b.shape[1] ** 2 > layer.weight.numel():
        return gram.linear_norms(layer, activations, backprops)
    a = activations[0].to(b.dtype).reshape(b.shape[0], b.shape[1], -1)
    squares = (torch.bmm(b, b.transpose(1, 2)) * torch.bmm(a, a.transpose(1, 2))).sum(dim=(1, 2))
    norms = {layer.weight: squares.clamp_min(0).sqrt()}
    if layer.bias is not None and layer.bias.requires_grad:
        norms[layer.bias] = b.sum(dim=1).norm(dim=1)
    return norms


def measure(name: str, quick: bool, rounds: int) -> dict:
    net, batch, description = make_case(name, quick)
    loss_fn = _loss_of(batch)
    with mock.patch("pl_dp.per_sample.ghost.linear_norms", _fp32_linear_norms):
        before = BookKeeping(copy.deepcopy(net), loss_fn)
    engine = BookKeeping(net, loss_fn)
    ratios: list[torch.Tensor] = []
    original = gram.gram_products

    def recording(*args, **kwargs):
        squares, bound = original(*args, **kwargs)
        ratios.append((bound / squares.abs().clamp_min(torch.finfo(squares.dtype).tiny)).detach())
        return squares, bound

    spreads: list[torch.Tensor] = []  # M/‖g‖ of every example at every floored norm
    floor = gram.floored

    def spread(norms, masses):
        spreads.append((masses / norms.double().clamp_min(1e-300)).detach())
        return floor(norms, masses)

    with (
        mock.patch.object(gram, "gram_products", recording),
        mock.patch.object(gram, "floored", spread),
        mock.patch("pl_dp.per_sample.tied.floored", spread),
    ):
        raised = engine.per_example_norms(batch)
    spreads_found = torch.cat(spreads)
    moved = raised.double() / before.per_example_norms(batch).double().clamp_min(1e-30) - 1
    found = torch.cat(ratios) if ratios else torch.zeros(1)
    params = [p for p in net.parameters() if p.requires_grad]

    def non_private():
        torch.autograd.grad(loss_fn(net, batch).sum(), params)

    steps = {
        "float64": lambda: engine.clipped_sum(batch, CLIP),
        "fp32": lambda: before.clipped_sum(batch, CLIP),
        "non_private": non_private,
    }
    times: dict[str, list[float]] = {key: [] for key in steps}
    for round_ in range(rounds + 1):
        for key, step in steps.items():
            start = time.perf_counter()
            step()
            if round_:  # round 0 warms up
                times[key].append((time.perf_counter() - start) * 1e3)
    medians = {key: statistics.median(values) for key, values in times.items()}
    return {
        "case": name,
        "description": description,
        "gram_calls": len(ratios),
        "bound_over_estimate_median": float(found.median()),
        "bound_over_estimate_max": float(found.max()),
        "norm_moved_largest": float(moved[moved.abs().argmax()]),
        "mass_over_norm_largest": float(spreads_found.max()),
        "floor_binds": int((spreads_found * gram.MASS_FLOOR > 1).sum()),
        "floored_norms": len(spreads_found),
        "clipped_sum_float64_ms": medians["float64"],
        "clipped_sum_fp32_ms": medians["fp32"],
        "non_private_ms": medians["non_private"],
        "float64_over_fp32": medians["float64"] / medians["fp32"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cases", nargs="+", default=["transformer", "minilm", "gpt2", "llama"])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 7)
    load_start = os.getloadavg()[0]
    rows = [measure(name, args.quick, rounds) for name in args.cases]
    load_end = os.getloadavg()[0]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()} CPU cores, medians of "
        f"{rounds} interleaved rounds; load average (1 min) {load_start:.1f} at the start, {load_end:.1f} at the end"
    )
    print(
        f"{'case':44} {'E/Ŝ median':>11} {'max':>9} {'norm moved':>11} {'M/‖g‖ max':>10} {'floored':>9} "
        f"{'bk ms':>8} {'fp32':>8} {'ratio':>6} {'non-private':>12}"
    )
    for r in rows:
        print(
            f"{r['description']:44} {r['bound_over_estimate_median']:>11.1e} {r['bound_over_estimate_max']:>9.1e} "
            f"{r['norm_moved_largest']:>11.1e} {r['mass_over_norm_largest']:>10.1f} "
            f"{r['floor_binds']:>4}/{r['floored_norms']:<4} "
            f"{r['clipped_sum_float64_ms']:>8.1f} {r['clipped_sum_fp32_ms']:>8.1f} "
            f"{r['float64_over_fp32']:>6.3f} {r['non_private_ms']:>12.1f}"
        )
    _write(args.json, rounds, load_start, load_end, rows)


if __name__ == "__main__":
    main()

"""Ghost clipping of tied input/output embeddings (GPT-2, OPT, Llama-style): exact norms and sensitivity ≤ C."""

import copy

import pytest
import torch
from torch import nn

from pl_dp.errors import ConfigError
from pl_dp.nets import CausalLM
from pl_dp.per_sample import GhostClipping
from pl_dp.per_sample.tied import tied_parameters
from pl_dp.privacy import ClipFunction
from pl_dp.step.batches import select_examples
from pl_dp.step.losses import causal_lm
from tests.tiny_hf import tiny_model

ARCHITECTURES = ["gpt2", "opt", "llama"]
#: OPT runs its MLP and the blocks' last LayerNorm on [batch x tokens, width] (refused under per-example norms), and
#: Opacus cannot hook its learned positions (an integer argument): the rest trains, the tied embedding included
_OPT_FROZEN = ("embed_positions", "fc1", "fc2", "layers.0.final_layer_norm", "layers.1.final_layer_norm")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {arch: tiny_model(tmp_path_factory.mktemp(arch), arch) for arch in ARCHITECTURES}


def _net(path, arch):
    net = CausalLM(model_path=path).eval()  # no dropout: every pass sees the same function
    for name, p in net.named_parameters():
        if arch == "opt" and any(part in name for part in _OPT_FROZEN):
            p.requires_grad_(False)
    return net


def _batch(size=5, length=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 300, (size, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0  # right padding
    mask[2, 7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[3, :4] = -100  # a prompt: no loss on its first tokens
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _materialized(net, batch):
    """Per-example gradients, one backward per example (no hooks): the reference."""
    params = [p for p in net.parameters() if p.requires_grad]
    rows = []
    for i in range(batch["input_ids"].shape[0]):
        one = select_examples(batch, torch.tensor([i]))
        grads = torch.autograd.grad(causal_lm(net, one).sum(), params, allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)])
    return rows


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tied_embeddings_norms_and_clipped_sums_equal_materialized_per_example_gradients(arch, models):
    net = _net(models[arch], arch)
    (tied, owners), *rest = tied_parameters(net)
    assert not rest and tied.requires_grad and len(owners) == 2  # the input embedding and the LM head
    batch = _batch()
    reference = _materialized(copy.deepcopy(net), batch)
    norms_ref = torch.stack([torch.sqrt(sum(g.double().square().sum() for g in row)) for row in reference])
    ghost = GhostClipping(net, causal_lm)
    for kind in ("constant", "automatic"):
        fn = ClipFunction(kind, clip=0.05, r=0.1)  # every example clipped
        sums, norms, nonfinite = ghost.clipped_sum(batch, fn)
        assert int(nonfinite) == 0
        torch.testing.assert_close(norms.double(), norms_ref, rtol=1e-5, atol=0)
        weights = fn.weights(norms_ref.float()).double()
        expected = [sum(w * row[j].double() for w, row in zip(weights, reference)) for j in range(len(sums))]
        error = torch.sqrt(sum((s.double() - e).square().sum() for s, e in zip(sums, expected)))
        assert error / torch.sqrt(sum(e.square().sum() for e in expected)) < 1e-5, kind
        j = next(j for j, p in enumerate(ghost.params) if p is tied)
        assert (sums[j].double() - expected[j]).norm() / expected[j].norm() < 1e-5, kind  # the tied weight alone


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_one_sequence_moves_the_clipped_sum_by_at_most_the_clip(arch, models):
    """Black box: D and D′ = D without one sequence; the clipped sums differ by at most C."""
    net = _net(models[arch], arch)
    ghost = GhostClipping(net, causal_lm)
    batch = _batch(size=6, seed=1)
    clip = 0.05
    for kind in ("constant", "automatic"):
        fn = ClipFunction(kind, clip=clip, r=0.01)
        with_it, norms, _ = ghost.clipped_sum(batch, fn)
        for removed in (0, 3):  # a padded sequence, a sequence with a prompt
            keep = torch.tensor([i for i in range(6) if i != removed])
            without, _, _ = ghost.clipped_sum(select_examples(batch, keep), fn)
            moved = torch.sqrt(sum((a - b).double().square().sum() for a, b in zip(with_it, without)))
            assert norms[removed] > 10 * clip  # unclipped it would move the sum far more
            assert moved <= clip * (1 + 1e-5), f"{kind}, without {removed}: moved {moved}"


def test_a_tied_parameter_in_another_place_than_a_linear_or_embedding_weight_is_refused():
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.bias = first.bias  # tied biases: not a shape the exact norms cover
    with pytest.raises(ConfigError, match="tied across modules"):
        GhostClipping(nn.Sequential(first, nn.Tanh(), second), lambda net, batch: net(batch).sum(dim=1))


def test_a_reused_layer_holding_a_tied_weight_is_refused():
    class Reused(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.head(self.embed(ids)) @ self.embed.weight)

    ghost = GhostClipping(Reused(), lambda net, ids: net(ids).sum(dim=(1, 2)))
    with pytest.raises(NotImplementedError, match="called more than once"):
        ghost.clipped_sum(torch.randint(0, 10, (3, 4)), ClipFunction("constant", 1.0))


class _TiedHead(nn.Module):
    """An embedding and an output layer sharing one weight (a language model's tied head, in a few lines)."""

    def __init__(self, vocabulary: int = 16, width: int = 8) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.head = nn.Linear(width, vocabulary, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embedding(ids)).mean(1))


@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_a_tied_weight_is_measured_in_fp32_under_autocast_so_one_example_moves_the_sum_by_at_most_the_clip(mode):
    """Under a bf16-mixed trainer (autocast) the passes compute in fp32, and so must the tied weights' norms: rounded
    in bf16, a norm set the clip weight of a gradient summed in fp32, and one example moved the sum by 1.0034·C (found
    by review, once book-keeping became the default)."""
    from pl_dp.per_sample.modes import get_per_sample_mode

    def loss(net, batch):
        ids, targets = batch
        return torch.nn.functional.cross_entropy(net(ids), targets, reduction="none")

    torch.manual_seed(0)
    engine = get_per_sample_mode(mode).build(_TiedHead(), loss, None)
    clip = ClipFunction("constant", clip=1e-3)
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(100):  # each example alone: the released sum is its clipped gradient
        example = (torch.randint(0, 16, (1, 6), generator=generator), torch.randint(0, 16, (1,), generator=generator))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            sums, _, _ = engine.clipped_sum(example, clip)
        worst = max(worst, float(torch.sqrt(sum(s.double().square().sum() for s in sums))) / clip.clip)
    assert worst <= 1 + 1e-5, worst

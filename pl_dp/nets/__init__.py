"""Reference networks and local Hugging Face classifiers and causal language models."""

from pl_dp.nets.causal import CausalLM, perplexity
from pl_dp.nets.hf import HFClassifier, MiniLMClassifier, minilm_path
from pl_dp.nets.mlp import MLP
from pl_dp.nets.prompt import PromptClassifier
from pl_dp.nets.transformer import TinyTransformerClassifier

__all__ = [
    "CausalLM",
    "HFClassifier",
    "MLP",
    "MiniLMClassifier",
    "PromptClassifier",
    "TinyTransformerClassifier",
    "minilm_path",
    "perplexity",
]

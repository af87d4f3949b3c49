"""Private fine-tuning of a small causal LM for generation, on real text that ships with installed packages.

    python benchmarks/generation.py            # ~25 minutes on 2 shared CPU cores
    python benchmarks/generation.py --quick    # a smoke test: tiny corpora, a few steps

No pretrained causal LM ships offline here, so the model is made in two public steps, then fine-tuned privately:

1. **Public pretraining** (no privacy: public data). A byte-level BPE tokenizer (2,048 tokens) and a random GPT-2
   (2 layers, width 64, 4 heads, tied input/output embeddings, 0.17M parameters) are trained on sentences of the
   docstrings of Python's own standard library (the interpreter running this script: public text).
2. **Private fine-tuning** on the descriptions of VADER's emoji lexicon (``emoji_utf8_lexicon.txt`` in the
   ``vaderSentiment`` package: 3,570 lines such as "face with tears of joy"), one description per example, about
   80 % private, 10 % validation, 10 % test (split by a hash of each description: copies stay together), with
   ``loss="causal_lm"`` and :class:`~pl_dp.data.TextGenerationDataModule`, at ε ∈ {1, 8} (δ = 1/n, PRV accountant):
   DP-SGD with ghost clipping on all parameters (the tied embedding included), DP-SGD with ghost clipping on LoRA
   adapters (rank 8 on ``c_attn``), and DPZero on all parameters.

Reported: test perplexity (token level, :func:`pl_dp.nets.perplexity`) of the pretrained model and after each run,
ε spent, wall time, and a few sampled continuations (post-processing of the private model: no privacy cost).
Prints a table and JSON (``--json PATH``; the committed copy is ``benchmarks/results/generation.json``).
``--workdir`` (``lightning_logs/generation``) keeps the pretrained model and the private texts
(``emoji_descriptions.jsonl``) for the configs ``configs/emoji/*.yaml``; ``--prepare`` makes only those.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _measure import quiet_trainer  # noqa: E402

from pl_dp import PrivacySpec  # noqa: E402
from pl_dp.data import TextGenerationDataModule  # noqa: E402
from pl_dp.methods import DPSGD, DPZero  # noqa: E402
from pl_dp.nets import CausalLM, perplexity  # noqa: E402

#: standard-library modules whose docstrings are the public corpus (imported; none with side effects)
STDLIB = [
    "abc",
    "argparse",
    "array",
    "ast",
    "asyncio",
    "base64",
    "bisect",
    "bz2",
    "calendar",
    "cmd",
    "code",
    "codecs",
    "collections",
    "colorsys",
    "compileall",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "doctest",
    "email",
    "enum",
    "filecmp",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "gc",
    "getopt",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "http.client",
    "imaplib",
    "importlib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "keyword",
    "locale",
    "logging",
    "lzma",
    "mailbox",
    "mimetypes",
    "mmap",
    "multiprocessing",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pickle",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "pprint",
    "pyclbr",
    "queue",
    "random",
    "re",
    "runpy",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "signal",
    "smtplib",
    "socket",
    "sqlite3",
    "ssl",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "symtable",
    "sysconfig",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "tomllib",
    "traceback",
    "typing",
    "unittest",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "xml.etree.ElementTree",
    "zipfile",
    "zoneinfo",
]
PROMPTS = ["face with", "smiling", "flag:", "man", "red"]


def docstring_sentences() -> list[str]:
    """Sentences (20–200 characters) of the docstrings of :data:`STDLIB` modules and their public members."""
    seen, out = set(), []
    for name in STDLIB:
        module = importlib.import_module(name)
        docs = [inspect.getdoc(module)]
        for member, value in vars(module).items():
            if not member.startswith("_") and (inspect.isclass(value) or inspect.isroutine(value)):
                docs.append(inspect.getdoc(value))
                if inspect.isclass(value):
                    docs += [inspect.getdoc(v) for k, v in vars(value).items() if not k.startswith("_")]
        for doc in filter(None, docs):
            for paragraph in doc.split("\n\n"):
                for sentence in re.split(r"(?<=[.!?])\s+", " ".join(paragraph.split())):
                    if 20 <= len(sentence) <= 200 and sentence not in seen and not sentence.startswith(">>>"):
                        seen.add(sentence)
                        out.append(sentence)
    return out


def emoji_descriptions() -> list[str]:
    """The descriptions of VADER's emoji lexicon, one per line of ``emoji_utf8_lexicon.txt``."""
    import vaderSentiment

    path = Path(vaderSentiment.__file__).parent / "emoji_utf8_lexicon.txt"
    return [line.split("\t")[1].strip() for line in path.read_text(encoding="utf-8").splitlines() if "\t" in line]


def random_gpt2(path: Path, sentences: list[str], width: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A byte-level BPE tokenizer (2,048 tokens) trained on ``sentences`` and a random GPT-2 (``layers`` × ``width``, 4
    heads, 64 positions, tied embeddings), saved at ``path``."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048, special_tokens=["<pad>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(sentences, trainer)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>")
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    config = tf.GPT2Config(
        vocab_size=len(fast), n_embd=width, n_layer=layers, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=1
    )
    tf.GPT2LMHeadModel(config).save_pretrained(path)
    return path


def pretrain(workdir: Path, sentences: list[str], epochs: int, seed: int = 0) -> Path:
    """Train the tokenizer and the GPT-2 on the public ``sentences`` (non-private: public data); save at workdir."""
    path = workdir / "public_gpt2"
    if (path / "config.json").is_file():
        return path
    random_gpt2(path, sentences, seed=seed)
    net = CausalLM(model_path=path)
    data = TextGenerationDataModule(
        data=sentences, tokenizer=path, batch_size=64, max_length=48, test_fraction=0.02, val_fraction=0.0
    )
    loader = torch.utils.data.DataLoader(data.private, batch_size=64, shuffle=True, collate_fn=data.collate_fn)
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    from pl_dp.step.losses import causal_lm

    for epoch in range(epochs):
        for batch in loader:
            optimizer.zero_grad()
            causal_lm(net, batch).mean().backward()
            optimizer.step()
        held_out = perplexity(net, data.test_dataloader())
        print(f"public pretraining, epoch {epoch + 1}: held-out docstring perplexity {held_out:.1f}", flush=True)
    net.model.save_pretrained(path)
    return path


def private_run(method: str, epsilon: float, model: Path, data: TextGenerationDataModule, epochs: int) -> dict:
    """One private fine-tuning run; test perplexity after it, ε spent, time and samples."""
    privacy = PrivacySpec(epsilon=epsilon, accountant="prv")
    if method == "dpzero":
        module = DPZero(
            CausalLM(model_path=model), loss="causal_lm", lr=1e-3, clip=1.0, smoothing=1e-3, privacy=privacy
        )
    else:
        trainable = "lora" if method == "dpsgd-ghost-lora" else "all"
        net = CausalLM(model_path=model, trainable=trainable, lora_targets=["c_attn"] if trainable == "lora" else None)
        lr = 1e-2 if trainable == "lora" else 1e-3
        module = DPSGD(net, loss="causal_lm", lr=lr, clip=1.0, optimizer="adam", per_sample="ghost", privacy=privacy)
    start = time.perf_counter()
    quiet_trainer(max_epochs=epochs).fit(module, datamodule=data)
    seconds = time.perf_counter() - start
    return {
        "method": method,
        "epsilon_target": epsilon,
        "epsilon": module.epsilon,
        "noise_multiplier": module.noise_multiplier,
        "private_steps": module.private_steps,
        "trained_parameters": sum(p.numel() for p in module.net.parameters() if p.requires_grad),
        "test_perplexity": perplexity(module.net, data.test_dataloader()),
        "seconds": seconds,
        "samples": dict(zip(PROMPTS, module.net.generate(PROMPTS, max_new_tokens=8, seed=0))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny corpora and one short epoch: a smoke test")
    parser.add_argument("--prepare", action="store_true", help="only pretrain the public model and write the texts")
    parser.add_argument("--epochs", type=int, default=3, help="private epochs")
    parser.add_argument("--pretrain-epochs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=ROOT / "lightning_logs" / "generation")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    public, private = docstring_sentences(), emoji_descriptions()
    if args.quick:
        public, private, args.epochs, args.pretrain_epochs = public[:2000], private[:600], 1, 1
        args.workdir = args.workdir / "quick"
    args.workdir.mkdir(parents=True, exist_ok=True)
    (args.workdir / "emoji_descriptions.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in private))
    print(f"public corpus: {len(public)} docstring sentences; private corpus: {len(private)} emoji descriptions")
    model = pretrain(args.workdir, public, args.pretrain_epochs)
    if args.prepare:
        print(f"public model: {model}; private texts: {args.workdir / 'emoji_descriptions.jsonl'}")
        return
    data = TextGenerationDataModule(data=private, tokenizer=model, batch_size=64, max_length=32)
    pretrained = CausalLM(model_path=model)
    before = {
        "test_perplexity": perplexity(pretrained, data.test_dataloader()),
        "samples": dict(zip(PROMPTS, pretrained.generate(PROMPTS, max_new_tokens=8, seed=0))),
    }
    print(f"pretrained (public only): test perplexity {before['test_perplexity']:.1f}", flush=True)
    runs = []
    for epsilon in (1.0, 8.0):
        for method in ("dpsgd-ghost", "dpsgd-ghost-lora", "dpzero"):
            runs.append(private_run(method, epsilon, model, data, args.epochs))
            r = runs[-1]
            print(
                f"{method:17s} eps {r['epsilon']:.2f}: test perplexity {r['test_perplexity']:.1f} "
                f"({r['private_steps']} steps, {r['seconds']:.0f} s)",
                flush=True,
            )
    result = {
        "corpora": {"public": len(public), "private": len(data.private), "val": len(data.val), "test": len(data.test)},
        "epochs": args.epochs,
        "batch_size": 64,
        "pretrained": before,
        "runs": runs,
        "command": "python benchmarks/generation.py" + (" --quick" if args.quick else ""),
    }
    print("\n| method | ε | test perplexity | steps | trained parameters | time (s) |\n|---|---|---|---|---|---|")
    print(f"| pretrained on public docstrings | — | {before['test_perplexity']:.1f} | 0 | — | — |")
    for r in runs:
        print(
            f"| {r['method']} | {r['epsilon']:.2f} | {r['test_perplexity']:.1f} | {r['private_steps']} | "
            f"{r['trained_parameters']:,} | {r['seconds']:.0f} |"
        )
    print("\nsamples (prompt → continuation), before and after DP-SGD ghost at ε = 8:")
    after = next(r for r in runs if r["method"] == "dpsgd-ghost" and r["epsilon_target"] == 8.0)
    for prompt in PROMPTS:
        print(f"  {prompt!r}: {before['samples'][prompt]!r} → {after['samples'][prompt]!r}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

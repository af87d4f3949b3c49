"""Privately fine-tune a local Hugging Face model on *your own* CSV of labelled texts, with a prompt.

Your file has a text column and a label column (class indices, or names listed with ``--label-names``)::

    text,label
    "The battery died after two days.",negative
    "Works exactly as described.",positive

The model scores one label word per class where a prompt asks for a word (PromptClassifier: LM-BFF-style prompts,
which are what make zeroth-order fine-tuning work, as MeZO found); the rows are split into private, validation
and test sets (about 80/10/10 %, each row by a keyed hash of itself and a fixed seed) and the private set is
Poisson-sampled. Nothing is downloaded: ``--model`` is a
local directory (a masked LM such as RoBERTa, a causal LM such as OPT, or a sentence encoder); by default the
all-MiniLM-L6-v2 encoder packaged with pl_dp's extras.

    python examples/finetune_your_csv.py reviews.csv --label-names negative positive --label-words terrible great
    python examples/finetune_your_csv.py --demo            # writes a demo CSV (VADER lexicon entries) and uses it
    python examples/finetune_your_csv.py reviews.csv --method dpsgd --trainable lora   # DP-SGD on LoRA adapters

It prints the zero-shot test accuracy (the prompt alone, before training), the accuracy after private training
and the ε spent. Only the private split is protected by ε; validation and test accuracy are computed without
noise on their own splits.
"""

from __future__ import annotations

import argparse
import csv
import tempfile
from pathlib import Path
from typing import Any

import lightning as L

from pl_dp import PrivacySpec
from pl_dp.callbacks import PrivacyBudget
from pl_dp.data import TextDataModule, vader_splits
from pl_dp.methods import DPSGD, DPZero
from pl_dp.nets import PromptClassifier


def write_demo_csv(path: Path, size: int = 1200) -> Path:
    """``size`` VADER lexicon entries as ``text,label`` rows with names, like a user's own file."""
    texts, labels = vader_splits()["private"]
    with path.open("w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(["text", "label"])
        writer.writerows((text, ["negative", "positive"][int(y)]) for text, y in zip(texts[:size], labels[:size]))
    return path


def main(
    csv_path: str | Path,
    model: str | None = None,
    label_words: tuple[str, ...] = ("terrible", "great"),
    label_names: tuple[str, ...] | None = ("negative", "positive"),
    template: str | None = None,
    method: str = "dpzero",
    trainable: str = "head",
    epsilon: float = 1.0,
    epochs: int = 2,
    max_steps: int = -1,
    batch_size: int = 32,
    lr: float | None = None,
    max_length: int = 64,
    seed: int = 0,
) -> dict[str, Any]:
    """Fine-tune with ``method`` ("dpzero" or "dpsgd") at ``epsilon``; returns accuracies and the ε spent."""
    L.seed_everything(seed)
    net = PromptClassifier(list(label_words), model_path=model, template=template, trainable=trainable)
    data = TextDataModule(
        str(csv_path),
        prompt=net,
        label_names=list(label_names) if label_names else None,
        max_length=max_length,
        batch_size=batch_size,
    )
    privacy = PrivacySpec(epsilon)
    if method == "dpzero":
        private = DPZero(net, lr=lr or 1e-2, clip=1.0, smoothing=1e-3, privacy=privacy)
    elif method == "dpsgd":
        private = DPSGD(net, lr=lr or 0.5, clip=1.0, clip_fn="automatic", privacy=privacy)
    else:
        raise ValueError(f"method must be 'dpzero' or 'dpsgd', got {method!r}.")
    trainer = L.Trainer(
        max_epochs=epochs,
        max_steps=max_steps,
        accelerator="auto",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[PrivacyBudget()],
    )
    zero_shot = trainer.test(private, data, verbose=False)[0]["test/acc"]
    trainer.fit(private, data)
    tested = trainer.test(private, data, verbose=False)[0]["test/acc"]
    result = {"zero_shot_acc": zero_shot, "test_acc": tested, "epsilon": private.epsilon, "delta": private.delta}
    result["private_steps"] = private.private_steps
    print(
        f"{net.kind} prompt {net.template!r}, label words {net.label_words}: zero-shot test accuracy "
        f"{zero_shot:.4f} -> {tested:.4f} after {method} on {len(data.private)} private texts "
        f"(epsilon {private.epsilon:.3f}, delta {private.delta:.2e})"
    )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="?", help="your CSV file (columns 'text' and 'label')")
    parser.add_argument("--demo", action="store_true", help="write a demo CSV from the VADER lexicon and use it")
    parser.add_argument("--model", help="a local Hugging Face model directory (default: the packaged MiniLM)")
    parser.add_argument("--label-words", nargs="+", default=["terrible", "great"])
    parser.add_argument("--label-names", nargs="+", default=["negative", "positive"])
    parser.add_argument("--template", help="the prompt, with {text} (and {mask} for a masked LM)")
    parser.add_argument("--method", choices=["dpzero", "dpsgd"], default="dpzero")
    parser.add_argument("--trainable", default="head", help="all, head, bias, last-N or lora")
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float)
    args = parser.parse_args()
    if args.demo == bool(args.csv):
        parser.error("give your CSV file or --demo")
    path = write_demo_csv(Path(tempfile.mkdtemp()) / "demo.csv") if args.demo else args.csv
    main(
        path,
        model=args.model,
        label_words=tuple(args.label_words),
        label_names=tuple(args.label_names),
        template=args.template,
        method=args.method,
        trainable=args.trainable,
        epsilon=args.epsilon,
        epochs=args.epochs,
        lr=args.lr,
    )

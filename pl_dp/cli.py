"""``pl-dp``: the LightningCLI entry point.

Any pl_dp method (or any user LightningModule / LightningDataModule) is selectable by class
path, e.g. ``pl-dp fit --config configs/digits/dpzero.yaml``. After ``fit`` the CLI tests the
final model and prints the test accuracy next to the ε spent (disable with
``--test_after_fit false``).
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI


class PlDpCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--test_after_fit", type=bool, default=True, help="test the model after fit and print a report"
        )

    def after_fit(self) -> None:
        if not self.config[self.subcommand].get("test_after_fit", True) or self.trainer.interrupted:
            return
        results = self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)
        if self.trainer.is_global_zero:
            print(report(self.model, results[0] if results else {}))


def report(model, test_metrics: dict) -> str:
    """One line: test accuracy and the privacy spent."""
    parts = []
    if "test/acc" in test_metrics:
        parts.append(f"test accuracy {test_metrics['test/acc']:.4f}")
    if getattr(model, "privacy", None) is not None and getattr(model, "delta", None) is not None:
        parts.append(
            f"epsilon {model.epsilon:.3f} (delta {model.delta:.2e}, {model.privacy.accountant} accountant, "
            f"noise multiplier {model.noise_multiplier:.4f}, {model.private_steps} private steps)"
        )
    elif hasattr(model, "privacy"):
        parts.append("non-private run (no privacy guarantee)")
    return "pl-dp: " + " | ".join(parts)


def main(args: list[str] | None = None) -> None:
    PlDpCLI(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":
    main()

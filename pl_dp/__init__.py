"""pl_dp: differentially private training methods for PyTorch Lightning."""

from pl_dp.privacy.spec import PrivacySpec

__all__ = ["PrivacySpec"]
__version__ = "0.2.0"  # the only place the version is written (pyproject.toml reads it)

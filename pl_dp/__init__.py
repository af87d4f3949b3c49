"""pl_dp: differentially private training methods for PyTorch Lightning."""

from pl_dp.privacy.spec import PrivacySpec

__all__ = ["PrivacySpec"]
__version__ = "0.1.0"

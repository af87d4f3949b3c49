"""How far a bundled dataset's public split is shifted from its private split: a class imbalance of chosen size.

The PAZO experiments (Gong & Li, 2025, §5.1 and App. C.1, Table 7) draw public data with class imbalance —
slight for in-distribution public data, large for out-of-distribution — and find every PAZO variant better the
closer the public data is to the private. The bundled datasets (:func:`~pl_dp.data.digits_splits`,
:func:`~pl_dp.data.vader_splits`) offer the same three levels, ``public_shift``:

* ``"none"``: the public split is a uniform draw from the training pool (in-distribution);
* ``"mild"``: the favoured class is 1.5 times as likely as the least favoured;
* ``"strong"``: 3 times (the default, the bundled datasets' public splits before these levels existed).

Class weights fall linearly over the classes, so for ten digits class 0 is 1.5 (mild) or 3 (strong) times as
likely as class 9. Public data is public: the shift is a property of the benchmark, not of the privacy guarantee.
"""

from __future__ import annotations

import numpy as np

from pl_dp.errors import ConfigError

PUBLIC_SHIFTS = {"none": 1.0, "mild": 1.5, "strong": 3.0}


def public_shift_weights(labels: np.ndarray, num_classes: int, shift: str, favoured: str = "first") -> np.ndarray:
    """Per-example weights of the public draw: linear in the class index, ``PUBLIC_SHIFTS[shift]`` from end to end.

    ``favoured="first"`` makes class 0 the most likely, ``"last"`` class ``num_classes − 1``. The weights average
    1 over the classes (for ``"strong"`` and ten classes: 1.5 − c/9).
    """
    if shift not in PUBLIC_SHIFTS:
        raise ConfigError(f"public_shift must be one of {sorted(PUBLIC_SHIFTS)}, got {shift!r}.")
    if favoured not in ("first", "last"):
        raise ConfigError(f"favoured must be 'first' or 'last', got {favoured!r}.")
    ratio = PUBLIC_SHIFTS[shift]
    position = 1.0 - 2.0 * np.asarray(labels, dtype=np.float64) / (num_classes - 1)  # +1 first class, −1 last
    if favoured == "last":
        position = -position
    return 1.0 + (ratio - 1.0) / (ratio + 1.0) * position

"""Weight functions: each example's contribution is bounded by C, whatever its gradient norm."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pl_dp.errors import ConfigError
from pl_dp.privacy import ClipFunction

norms = st.lists(st.floats(0.0, 1e8, allow_nan=False), min_size=1, max_size=50)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["constant", "automatic", "psac"]), clip=st.floats(1e-3, 1e3), r=st.floats(1e-3, 1.0), s=norms
)
def test_sensitivity_never_exceeds_clip(kind, clip, r, s):
    fn = ClipFunction(kind, clip, r)
    s = torch.tensor(s, dtype=torch.float64)
    contribution = s * fn.weights(s).double()
    assert (contribution <= fn.sensitivity * (1 + 1e-6)).all()
    assert fn.sensitivity == clip


@settings(max_examples=200, deadline=None)
@given(clip=st.floats(1e-3, 1e3), r=st.floats(1e-3, 1.0), s=norms)
def test_psac_weight_bound(clip, r, s):
    w = ClipFunction("psac", clip, r).weights(torch.tensor(s, dtype=torch.float64)).double()
    assert (w <= clip / (2 * math.sqrt(r) - r) * (1 + 1e-6)).all()


def test_known_values():
    s = torch.tensor([0.0, 0.5, 2.0])
    torch.testing.assert_close(ClipFunction("constant", 1.0).weights(s), torch.tensor([1.0, 1.0, 0.5]))
    torch.testing.assert_close(ClipFunction("automatic", 1.0, 0.1).weights(s), 1 / (s + 0.1))
    torch.testing.assert_close(ClipFunction("psac", 1.0, 0.1).weights(s), 1 / (s + 0.1 / (s + 0.1)))
    assert ClipFunction("psac", 1.0, 0.1).weights(torch.tensor([0.0])).item() == pytest.approx(1.0)
    assert ClipFunction("psac", 1.0, 0.1).max_weight == pytest.approx(1.878, abs=1e-3)


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"kind": "nope"}, "clip_fn"), ({"clip": 0}, "clip"), ({"kind": "automatic", "r": 0}, "r")]
)
def test_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ClipFunction(**kwargs)

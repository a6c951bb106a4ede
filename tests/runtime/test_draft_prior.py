"""Adaptive k's prior comes from the manifest: a damaged value is a ManifestError at load,
not a TypeError in the middle of a request (found by scripts/fuzz_manifest.py on the
default engines: `top1_agreement = []`)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from specrt.errors import ManifestError
from specrt.runtime.batch.one_row import draft_prior as _draft_prior


def _man(parity):
    return SimpleNamespace(draft=SimpleNamespace(parity=parity))


@pytest.mark.parametrize("parity, prior", [({"agreement_with_target": {"top1_agreement": 0.7}}, 0.7),
                                           ({"agreement_with_target": {"top1_agreement": 1}}, 1.0),
                                           ({}, 0.8), (None, 0.8), ({"agreement_with_target": {}}, 0.8)])
def test_the_recorded_agreement_or_the_default(parity, prior):
    assert _draft_prior(_man(parity)) == prior
    assert _draft_prior(SimpleNamespace(draft=None)) == 0.8


@pytest.mark.parametrize("bad", [[], "0.9", True, 1.5, -0.1, None, {"x": 1}])
def test_a_damaged_value_is_a_manifest_error(bad):
    with pytest.raises(ManifestError, match="top1_agreement"):
        _draft_prior(_man({"agreement_with_target": {"top1_agreement": bad}}))
    with pytest.raises(ManifestError):
        _draft_prior(_man({"agreement_with_target": [bad]}))

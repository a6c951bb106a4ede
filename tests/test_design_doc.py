"""docs/DESIGN.md names real things: every path it mentions exists, the backends it lists are the
registered ones, the proposers it lists are the package's Proposer implementations."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "DESIGN.md").read_text()


def test_every_path_the_design_names_exists():
    paths = set(re.findall(r"`((?:specrt|tests|docs)/[\w/.<>-]+)`", DOC))
    paths |= {"specrt/" + p for p in re.findall(r"`((?:runtime|build|export|calibration|serve|tools|engines)/"
                                              r"[\w/.-]+\.py)`", DOC)}
    missing = [p for p in sorted(paths) if "<" not in p and not (ROOT / p).exists()]
    assert len(paths) > 20 and not missing, missing


def test_the_backends_named_are_the_registered_ones():
    from specrt.runtime.backends import registered
    sentence = DOC[DOC.index("Registered backends:"):].split(".")[0]
    named = set(re.findall(r"`([\w-]+)`", sentence))
    assert named == {b.name for b in registered()}


def test_the_proposers_named_are_the_implementations():
    import specrt.runtime.proposers as props
    from specrt.runtime.proposers import Proposer
    sentence = DOC[DOC.index("Implementations:"):DOC.index("`Chain`")]
    named = set(re.findall(r"`(\w+)`", sentence))
    impl = {n for n in props.__all__ if isinstance(getattr(props, n), type) and n not in ("Proposal", "Proposer",
            "Chain") and hasattr(getattr(props, n), "propose")}
    assert named == impl, (named, impl)
    assert Proposer.__name__ == "Proposer"

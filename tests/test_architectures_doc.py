"""docs/architectures.md's support table is the registry: the same model types, each
family's declared fields, the attention variants the exporter has, and test cases that
exist for each row (tests/tiny_models.py ARCHITECTURE_CASES, or the older families'
tests)."""
from __future__ import annotations

import re
from pathlib import Path

from tiny_models import ARCHITECTURE_CASES, FAMILIES

from specrt.export import specs
from specrt.export.graph import ATTENTION

DOC = Path(__file__).parent.parent / "docs" / "architectures.md"


def _section(title: str) -> list[list[str]]:
    """The rows of the first table under `## title`, as lists of cell strings."""
    text = DOC.read_text(encoding="utf-8").split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in rows]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_the_table_lists_exactly_the_registered_model_types():
    rows = _section("The table")
    types = [_ticked(r[0])[0] for r in rows]
    assert sorted(types) == specs.supported_model_types()
    assert len(types) == len(set(types))


def test_each_row_declares_what_its_spec_declares():
    for model_type, family, declared, attention, _ in _section("The table"):
        spec = specs.spec_for(_ticked(model_type)[0])
        assert family == spec.family, model_type
        assert tuple(_ticked(declared)) == spec.declared(), model_type
        assert [a.strip() for a in attention.split(",")] == list(ATTENTION), model_type


def test_each_row_names_test_cases_that_exist_for_its_model_type():
    known = set(ARCHITECTURE_CASES) | set(FAMILIES)
    named = {}
    for model_type, *_, tested in _section("The table"):
        mt = _ticked(model_type)[0]
        cases = _ticked(tested)
        assert cases and set(cases) <= known, (mt, cases)
        # a case belongs to the row of the family its tiny model is made from
        assert any(ARCHITECTURE_CASES.get(c, (c,))[0] == mt for c in cases), (mt, cases)
        named.update({c: mt for c in cases})
    for case, (family, _) in ARCHITECTURE_CASES.items():
        assert named.get(case) == family, f"case {case} is not in the {family} row"


def test_the_field_glossary_lists_every_declared_field():
    glossary = [_ticked(r[0])[0] for r in _section("The declared fields")]
    base = ["norm", "positions", "mlp", "fused_qkv", "conv1d"]
    assert glossary == base + list(specs.FEATURES)

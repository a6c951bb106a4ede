"""`specrt profile`: ONNX Runtime's per-operator profile as a table, a CSV and one Chrome trace."""
from __future__ import annotations

import csv
import json

from specrt import cli


def test_profile_writes_a_trace_and_an_operator_table_for_every_graph(tiny_self_engines, tmp_path, capsys):
    out = tmp_path / "prof"
    assert cli.main(["profile", str(tiny_self_engines), "--out", str(out), "--max-new-tokens", "6"]) == 0
    rows = list(csv.DictReader(open(out / "ops.csv")))
    graphs = {r["graph"] for r in rows}
    assert graphs == {"target/prefill", "target/verify", "draft/decode"}     # methods=("speculative",)
    for g in graphs:
        shares = [float(r["share"]) for r in rows if r["graph"] == g]
        assert abs(sum(shares) - 1.0) < 0.01 and all(int(r["runs"]) >= 1 for r in rows if r["graph"] == g)
    assert any(r["op_type"] in ("MatMul", "MatMulNBits") for r in rows if r["graph"] == "target/verify")
    trace = json.loads((out / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace if e.get("ph") == "M"}
    assert names == graphs and sum(e.get("cat") == "Node" for e in trace) > 10
    printed = capsys.readouterr().out
    assert "target/verify" in printed and "share" in printed


def test_profile_of_plain_decoding_uses_the_one_token_graph(tiny_self_engines, tmp_path):
    out = tmp_path / "prof"
    assert cli.main(["profile", str(tiny_self_engines), "--out", str(out), "--max-new-tokens", "4", "--plain"]) == 0
    graphs = {r["graph"] for r in csv.DictReader(open(out / "ops.csv"))}
    assert graphs == {"target/prefill", "target/decode"}

"""`python -m eval.bench all --quick` end to end (the README's command, about 2 minutes on 2 cores): every part
runs and writes its JSON and figure. It checks that the suite runs and what it writes, never the speed it
measures."""
import json

from eval.bench.__main__ import PARTS, main


def test_every_part_writes_rows_machine_ratios_and_a_figure(tmp_path, capsys):
    assert main(["all", "--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for part in PARTS:
        res = json.loads((tmp_path / f"{part}.json").read_text())
        assert res["part"] == part and res["mode"] == "quick"
        assert {"platform", "processor", "torch", "threads", "device"} <= set(res["machine"])
        assert res["settings"] and res["rows"]
        for r in res["rows"]:
            assert {"candidate", "setting", "metric", "unit", "median", "spread", "n", "ratio_vs_baseline"} <= set(r)
            assert r["median"] > 0 and r["n"] >= 2 and r["spread"]["min"] <= r["median"] <= r["spread"]["max"]
        # Every setting has exactly one baseline row, at ratio 1.
        for setting in {(json.dumps(r["setting"], sort_keys=True), r["metric"]) for r in res["rows"]}:
            ratios = [r["ratio_vs_baseline"] for r in res["rows"]
                      if (json.dumps(r["setting"], sort_keys=True), r["metric"]) == setting]
            assert len(ratios) >= 2 and ratios[0] == 1.0
        assert (tmp_path / f"{part}.png").stat().st_size > 0
        assert f"== {part} ==" in printed

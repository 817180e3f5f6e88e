"""The throughput table shows each method's fraction of its floor beside its ratio to BF16, and the
ceilings the run measured (synthetic records: values made up, records real)."""

from mosaicquant.reports.cells import aggregate_cells
from mosaicquant.reports.speed import suite_groups, throughput_table
from mosaicquant.reports.tables import write_tables

SPEED = "llama-3-8b-shapes"
CEILINGS = {"copy_gb_s": 2900.0, "bf16_tflop_s": 700.0, "int8_tflop_s": 1300.0, "gpu": "NVIDIA H100 80GB HBM3"}


def _speed_info(form, wbits):
    return {"wbits": wbits, "abits": wbits, "kv_bits": 16, "exec_path_speed": f"{form} path",
            "speed": {"runtime": "fused", "form": form, "ceilings": CEILINGS}}


def _write(out, write_cell, speed_metrics, label, decode, floors, prefill_floor, form, wbits):
    metrics = speed_metrics[0](decode, prefill=40000.0)
    metrics.update({f"decode_floor_frac/b{b}": (f, True, "of floor") for b, f in floors.items()})
    metrics["prefill_floor_frac"] = (prefill_floor, True, "of floor")
    write_cell(out, SPEED, label, "throughput", metrics, info=_speed_info(form, wbits))


def test_floor_fractions_sit_beside_the_ratios_and_the_ceilings_are_stated(tmp_path, write_cell, speed_metrics):
    out = tmp_path / "res"
    _write(out, write_cell, speed_metrics, "fp16", {4: 600.0, 32: 4000.0}, {4: 0.82, 32: 0.8}, 0.61, "bf16", 16)
    _write(out, write_cell, speed_metrics, "rtn", {4: 1200.0, 32: 6000.0}, {4: 0.55, 32: 0.43}, 0.3, "kernels", 4)
    # a record of an older run: no floors, no form
    write_cell(out, SPEED, "quarot", "throughput", speed_metrics[0]({4: 900.0}))
    from mosaicquant.harness.results import load_records

    group = suite_groups(aggregate_cells(load_records(out)).values(), "throughput")[(SPEED, "throughput")]
    table = throughput_table(group).set_index("method")
    assert table.loc["rtn", "decode tok/s (batch 4) ↑"].endswith("(2.00×)")
    assert table.loc["rtn", "batch 4: of byte floor"] == "55%" and table.loc["rtn", "batch 32: of byte floor"] == "43%"
    assert table.loc["fp16", "batch 4: of byte floor"] == "82%"
    assert table.loc["rtn", "prefill: of flop floor"] == "30%"
    assert table.loc["rtn", "form"] == "kernels" and table.loc["fp16", "form"] == "bf16"
    assert table.loc["quarot", "batch 4: of byte floor"] == "" and table.loc["quarot", "form"] == ""
    report = write_tables(out).read_text()
    assert "Ceilings measured in this run: NVIDIA H100 80GB HBM3: copy 2,900 GB/s (read + write), BF16 700 " \
           "TFLOP/s, INT8 1,300 TOP/s." in report
    assert "of byte floor" in report and "| form |" in report


def test_without_floors_the_table_has_no_floor_columns(tmp_path, write_cell, speed_metrics):
    out = tmp_path / "res"
    write_cell(out, SPEED, "fp16", "throughput", speed_metrics[0]({4: 600.0}))
    from mosaicquant.harness.results import load_records

    group = suite_groups(aggregate_cells(load_records(out)).values(), "throughput")[(SPEED, "throughput")]
    assert not [c for c in throughput_table(group).columns if "floor" in c]
    assert "Ceilings measured" not in write_tables(out).read_text()

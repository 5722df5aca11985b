"""Run-log schema validation and plot_run's PNG (or its clear error without matplotlib)."""

import importlib.util
import json
import struct

import pytest

from zero_profiler import load_run_log, phase_series, plot_run, write_run_log

RECORDS = [
    {"step": 1, "loss": 4.2, "seconds": {"forward": 0.10, "backward": 0.20, "step": 0.05}},
    {"step": 2, "loss": None, "seconds": {"forward": 0.11, "backward": 0.19, "step": 0.05, "allgather_wait": 0.02}},
    {"step": 3, "loss": 3.9, "seconds": {"forward": 0.09, "backward": 0.21}, "lr": 1e-3},
]


def test_round_trip_and_series(tmp_path):
    path = write_run_log(RECORDS, tmp_path / "run.json")
    records = load_run_log(path)
    assert [r.step for r in records] == [1, 2, 3]
    assert records[1].loss is None and records[2].extra == {"lr": 1e-3}
    assert json.loads(path.read_text())[2] == RECORDS[2]
    steps, series = phase_series(records)
    assert steps == [1, 2, 3]
    assert list(series) == ["forward", "backward", "step", "allgather_wait"]
    assert series["step"] == [0.05, 0.05, 0.0] and series["allgather_wait"] == [0.0, 0.02, 0.0]
    jsonl = tmp_path / "run.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    assert load_run_log(jsonl) == records


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], "run log is empty"),
        ([{"step": 1, "loss": 1.0}], r"record 0: missing \['seconds'\]"),
        ([{"step": -1, "loss": 1.0, "seconds": {}}], "'step' must be an int >= 0, got -1"),
        ([{"step": 1, "loss": "x", "seconds": {}}], "'loss' must be a number or null"),
        ([{"step": 1, "loss": 1.0, "seconds": [0.1]}], "'seconds' must map phase -> seconds, got list"),
        ([{"step": 1, "loss": 1.0, "seconds": {"forward": -0.1}}], r"seconds\['forward'\] must be a finite number"),
        ([RECORDS[1], RECORDS[0]], "record 1: step 1 does not follow step 2"),
    ],
)
def test_malformed_logs_are_rejected_naming_record_and_field(bad, message):
    with pytest.raises(ValueError, match=message):
        load_run_log(bad)


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plot_run_writes_a_png_or_names_the_missing_extra(tmp_path):
    path = write_run_log(RECORDS, tmp_path / "run.json")
    out = tmp_path / "run.png"
    if importlib.util.find_spec("matplotlib") is None:  # a lone install without the `plot` extra
        with pytest.raises(ImportError, match=r"zero-profiler\[plot\]"):
            plot_run(path, out)
        return
    assert plot_run(path, out, dpi=50) == out
    assert _png_size(out) == (450, 325)  # figsize 9 x 6.5 inches at 50 dpi
    with pytest.raises(ValueError, match="run log is empty"):
        plot_run([], tmp_path / "empty.png")

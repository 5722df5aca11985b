"""Monitors (`tensorboard`, `wandb`, `csv_monitor`, `comet`) through zero.initialize on 2 ranks: the files are read
back with each library's own reader (TensorBoard's EventAccumulator, the CSV rows, the offline wandb run's records)
and hold DeepSpeed's event names with the values the engine saw, at x = samples trained. Only rank 0 writes."""

import csv
import glob
import os
import struct
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero
from zero_comm.testing import run_ranks

MICRO, GAS, STEPS = 2, 2, 3


def _body(out_dir: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=out_dir)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
           "steps_per_print": 2, "wall_clock_breakdown": True,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}},
           "zero_optimization": {"stage": 2},
           "tensorboard": {"enabled": True, "output_path": os.path.join(out_dir, "tb"), "job_name": "job"},
           "csv_monitor": {"enabled": True, "output_path": os.path.join(out_dir, "csv"), "job_name": "job"},
           "wandb": {"enabled": True, "project": "zero-test"},
           "comet": {"enabled": False}}  # fmt: skip
    engine = zero.initialize(model=model, config=cfg)[0]
    seen = []
    g = torch.Generator().manual_seed(1)
    for _step in range(STEPS):
        for _ in range(GAS):
            x, y = torch.randn(world, MICRO, 4, generator=g)[rank], torch.randn(world, MICRO, 1, generator=g)[rank]
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        seen.append((float(loss), engine.get_lr()[0], engine.get_global_grad_norm(), engine.global_samples))
    engine.close_monitor()
    return seen, engine.monitor is not None


def _wandb_history(run_file: str) -> list[dict]:
    """History rows of an offline wandb run: its .wandb file is a LevelDB-style log (7-byte header, 32 KiB blocks,
    records of crc32/length/type + data) of ``wandb_internal_pb2.Record`` protobufs."""
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B", "not a wandb run file"
    pos, rows, pending = 7, [], b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # block trailer padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += room
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_every_monitor_writes_deepspeed_events(tmp_path):
    results = run_ranks(_body, 2, str(tmp_path), timeout=180)
    seen, has_monitor = results[0]
    assert has_monitor and results[1][1] is False, "rank 0 alone owns the monitor"
    samples = [s[3] for s in seen]
    assert samples == [MICRO * GAS * 2 * (i + 1) for i in range(STEPS)]
    expected = {"Train/Samples/train_loss": [s[0] for s in seen], "Train/Samples/lr": [s[1] for s in seen],
                "Train/Samples/grad_norm": [s[2] for s in seen]}  # fmt: skip

    # TensorBoard, through its own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / "job"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert set(expected) | {"Train/Samples/elapsed_time_ms_forward", "Train/Samples/elapsed_time_ms_step"} <= tags
    assert "Train/Samples/loss_scale" not in tags  # fp16 only
    for tag, values in expected.items():
        events = acc.Scalars(tag)
        assert [e.step for e in events] == samples, tag
        assert [e.value for e in events] == pytest.approx(values, rel=1e-6), tag

    # CSV, DeepSpeed's layout: one file per event, header "step,<last name part>"
    for tag, values in expected.items():
        path = tmp_path / "csv" / "job" / (tag.replace("/", "_") + ".csv")
        rows = list(csv.reader(open(path)))
        assert rows[0] == ["step", tag.split("/")[-1]]
        assert [int(r[0]) for r in rows[1:]] == samples
        assert [float(r[1]) for r in rows[1:]] == pytest.approx(values, rel=1e-6)

    # wandb, offline run's records
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, runs  # rank 0 only
    history = _wandb_history(runs[0])
    for tag, values in expected.items():
        logged = [(row["_step"], row[tag]) for row in history if tag in row]
        assert [s for s, _ in logged] == samples, (tag, history)
        assert [v for _, v in logged] == pytest.approx(values, rel=1e-6), tag


def _missing_comet():
    sys.modules["comet_ml"] = None  # makes `import comet_ml` raise ImportError, installed or not
    model = torch.nn.Linear(2, 2)
    cfg = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "comet": {"enabled": True}}
    try:
        zero.initialize(model=model, config=cfg)
    except zero.ConfigError as e:
        return str(e)
    return None


def test_missing_library_names_the_extra():
    msg = run_ranks(_missing_comet, 1, timeout=60)[0]
    assert msg is not None and "'comet.enabled'" in msg and "pip install 'zero[comet]'" in msg, msg

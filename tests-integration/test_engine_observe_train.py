"""`zero train` with the observing config keys on 2 ranks (tiny Llama, ZeRO-3 default), then `zero plot` on its log.

Checks the main job's wiring end to end: the `flops_profiler` table is printed once with a per-token figure that
agrees with its own JSON (full, unsharded parameter counts under ZeRO-3), `wall_clock_breakdown` and
`comms_logger` print at `steps_per_print`, every run-log record carries `seconds` per phase, and `zero plot`
turns the log into a PNG that decodes.
"""

import copy
import json
import re
import subprocess
import sys

SEQ, MICRO = 64, 4


def _zero(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "zero.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_train_with_observers_then_zero_plot(tmp_path):
    from zero.commands.train import DEFAULT_CONFIG
    from zero.train.model import build_model

    cfg = copy.deepcopy(DEFAULT_CONFIG)
    cfg.update(wall_clock_breakdown=True, steps_per_print=2, comms_logger={"enabled": True},
               flops_profiler={"enabled": True, "profile_step": 2, "detailed": False,
                               "output_file": str(tmp_path / "flops.json")})  # fmt: skip
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    out = _zero("train", "--model-size", "tiny", "--max-data-mb", "1", "--seq-len", str(SEQ), "--steps", "3",
                "--runs-dir", str(tmp_path / "runs"), "--name", "obs", "--config", str(cfg_path))  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout

    # flops_profiler: one table, for step 2, whose per-token ratio is the JSON's totals over this rank's tokens.
    assert text.count("zero flops profiler - step 2") == 1
    totals = json.loads((tmp_path / "flops.json").read_text())["totals"]
    assert totals["params"] == sum(p.numel() for p in build_model("tiny", SEQ, 0).parameters())  # not shards
    tokens = MICRO * SEQ  # gradient_accumulation_steps 1: one micro-batch of MICRO windows of SEQ tokens per rank
    per_token = (totals["forward"]["flops"] + totals["backward"]["flops"]) / tokens
    m = re.search(rf"over {tokens} tokens = ([0-9.]+) x \(6 x non-embedding params\)", text)
    assert m is not None, text[-3000:]
    assert float(m.group(1)) == round(per_token / (6 * totals["non_embedding_params"]), 3)

    # wall_clock_breakdown and comms_logger print at steps_per_print (step 2 of 3), from rank 0 only.
    assert text.count("step 2: time per step over the last 2 step(s):") == 1
    assert text.count("step 2: collectives on rank 0") == 1 and "collectives on rank 1" not in text
    assert "| all_gather_into_tensor |" in text and "| reduce_scatter_tensor |" in text

    # Run log: every record has seconds per phase in zero_profiler's schema.
    log = tmp_path / "runs" / "obs" / "log.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert set(r["seconds"]) == {"data", "forward", "backward", "step"}
        assert all(v >= 0 for v in r["seconds"].values()) and r["seconds"]["forward"] > 0
        assert sum(r["seconds"].values()) <= r["step_s"]

    # zero plot: a PNG that decodes to an RGBA image of the requested size.
    import matplotlib.image

    from zero.cli import main

    png = tmp_path / "breakdown.png"  # the command in this process: a second interpreter start-up adds nothing here
    assert main(["plot", str(log), str(png), "--dpi", "50"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(png).shape == (325, 450, 4)  # 9 x 6.5 inches at 50 dpi

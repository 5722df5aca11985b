"""Run every benchmark in one go and write docs/benchmarks.md (the command, versions, CPU model, date, tables).

Usage (what `nox -s bench` runs): python benchmarks/run_all.py [--quick] [--only comm,adam,training]
Each section is a ratio against a peer measured in the same run; this machine is shared and noisy, so medians.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import platform
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

SECTIONS = {
    "comm": ("Collectives and ZeRO++ bytes on the wire (zero-comm)", "bench_comm"),
    "adam": ("Optimizer step (zero-kernels CPU Adam vs torch and DeepSpeed)", "bench_adam"),
    "training": ("Training step side by side (zero vs DeepSpeed vs FSDP2 vs DDP)", "bench_training"),
    "onebit": ("1-bit optimizers and activation partitioning (bytes, step time, main job loss)", "bench_onebit"),
    "bind_cores": ("zero run --bind_cores_to_rank on the main job (pinned vs unpinned ranks)", "bench_bind_cores"),
    "autotune": ("zero autotune: model-based tuner vs exhaustive grid (Llama, 2 ranks)", "bench_autotune"),
    "compile": ("Compiled ZeRO-3 / ZeRO-1 (zero-compile passes) vs eager and plain torch_compile", "bench_compile"),
    "offload": ("Offload: optimizer and parameter offload step", "bench_offload"),
    "nvme": ("NVMe offload: I/O engine vs fio and DeepSpeed async_io, NVMe step vs DeepSpeed", "bench_nvme"),
    "nvme_rss": ("NVMe offload: peak RSS per rank at stage 3 against its formula", "bench_nvme_rss"),
    "zenflow": ("ZenFlow: step and loss against ZeRO-Offload (Llama, 2 ranks)", "bench_zenflow"),
    "muon": ("Muon at ZeRO-2: optimizer-state bytes against the formula, step time vs DeepSpeed's Muon", "bench_muon"),
    "inference": (
        "ZeRO-Inference: stage-3 engine without an optimizer vs the dense model (RSS, forward)",
        "bench_inference",
    ),
    "decode": (
        "Decoding on the CPU: transformers vs init_inference AutoTP vs fused blocks vs DeepSpeed; hybrid rollouts",
        "bench_decode",
    ),
    "dpo": ("DPO step: ZeRO-3 policy + frozen ZeRO-3 reference, zero vs DeepSpeed", "bench_dpo"),
    "moe": ("MoE expert parallelism: ep=2/4 vs DeepSpeed's MoE layer and a ZeRO-3 leaf module, bytes", "bench_moe"),
    "tp": ("Tensor parallelism (AutoTP tp=2): zero vs DeepSpeed, vs dp=2 ZeRO-1, model-state bytes", "bench_tp"),
    "cpu_attention": (
        "CPU attention in fp32: bf16/fp16 attention through zero-compile's cpu_attention pass vs torch's kernel",
        "bench_cpu_attention",
    ),
    "pipeline": (
        "Pipeline parallelism: bubble fraction of 1F1B / interleaved / ZB-H1 against theory, step vs DeepSpeed",
        "bench_pipeline",
    ),
    "pipeline_budget": (
        "Pipeline parallelism: the largest Llama under a per-rank memory budget, pp=2 vs dp=2 ZeRO-1",
        "bench_pipeline_budget",
    ),
    "sp": ("Ulysses sequence parallelism: longest sequence under a memory budget, RSS, step vs DeepSpeed", "bench_sp"),
    "quantization": (
        "Subchannel quantized training: quantized Linear error, main job's loss against bf16 and fp32",
        "bench_quantized",
    ),
}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


# Sections no benchmark here produces, kept as written: the GPU checks' figures, recorded from a lent GPU machine.
RECORDED_TITLE_PREFIX = "GPU checks on "


def _existing_sections(path: Path) -> dict[str, str]:
    """Section key -> its text in an existing docs/benchmarks.md (from its ``## title`` line to the next one; a
    ``##`` title no section has stays inside the section before it). A recorded section (title starting with
    :data:`RECORDED_TITLE_PREFIX`) is its own entry, keyed by its title."""
    if not path.exists():
        return {}
    text = path.read_text()
    by_title = {f"## {title}\n": key for key, (title, _) in SECTIONS.items()}
    starts = []
    for line_start in [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]:
        if not text.startswith("## ", line_start):
            continue
        line = text[line_start : text.find("\n", line_start) + 1]
        if line in by_title:
            starts.append((line_start, by_title[line]))
        elif line[3:].startswith(RECORDED_TITLE_PREFIX):
            starts.append((line_start, line[3:].strip()))
    out = {}
    for i, (pos, key) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        out[key] = text[pos:end]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--output", default=str(ROOT / "docs" / "benchmarks.md"))
    args = ap.parse_args()
    only = args.only.split(",")
    unknown = [k for k in only if k not in SECTIONS]
    if unknown:
        ap.error(f"--only: unknown sections {unknown}; choose from {sorted(SECTIONS)}")
    command = "python3 -m nox -s bench" + (" --" if args.quick or only != list(SECTIONS) else "")
    command += " --quick" if args.quick else ""
    command += f" --only {args.only}" if only != list(SECTIONS) else ""
    cores = len(__import__("os").sched_getaffinity(0))
    header = [
        "# Benchmarks",
        "",
        "Produced by `python3 -m nox -s bench` (every section) or `python3 -m nox -s bench -- --only KEY` (one "
        "section, the others kept as they were). Each section states the command, date, CPU and versions of the run "
        "that produced it. Medians; ratios are against a peer measured in the same run (this machine is shared and "
        "noisy: compare within a table, not across runs).",
        "",
    ]
    stamp = (
        f"_Command: `{command}` on {datetime.date.today().isoformat()}; CPU: {cpu_model()}, {cores} cores; "
        f"torch {version('torch')}, deepspeed {version('deepspeed')}, zero {version('zero')}._\n"
    )
    kept = _existing_sections(Path(args.output))
    fresh: dict[str, str] = {}
    failed = []
    for key in only:
        title, module = SECTIONS[key]
        try:
            mod = __import__(module)
            fresh[key] = f"## {title}\n\n{stamp}\n" + mod.main(["--quick"] if args.quick else [])
        except Exception:  # noqa: BLE001 - one failed section must not hide the others' figures
            failed.append(key)
            fresh[key] = f"## {title}\n\n{stamp}\nFAILED:\n```\n{traceback.format_exc()[-2000:]}\n```"
    parts = header + [fresh.get(k, kept.get(k, "")).rstrip() + "\n" for k in SECTIONS if k in fresh or k in kept]
    parts += [text.rstrip() + "\n" for k, text in kept.items() if k not in SECTIONS]
    Path(args.output).write_text("\n".join(parts))
    print("\n".join(parts))
    if failed:
        print(f"bench: sections failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""NVMe offload (ZeRO-Infinity's optimizer part): the async I/O engine against fio and DeepSpeed 0.19.8's async_io
op on one file, fio's io_uring / libaio / thread-pool engines (the design choice), the pipelined NVMe optimizer step
against its bound, and a training step against DeepSpeed with the same nvme config, in one run.

I/O: a file of ``--io-mib`` MiB (1 GiB; 256 MiB with --quick) under .nox/bench_io on the working disk, written then
read whole with O_DIRECT, 1 MiB blocks, queue depth 8 (DeepSpeed's ``aio`` defaults): 16 requests of 1/16 of the
file from one aligned buffer, all submitted then waited, the same for our engine and DeepSpeed's; fio with the same
block size and depth. Medians of 5 interleaved passes. fio and libaio-dev (for DeepSpeed's op) come from Debian's
packages: the bench apt-gets them when missing and it runs as root, else leaves the column empty with a note.
DeepSpeed's op is built once into .nox/torch_extensions (about 389 s here, cached).

Usage: python benchmarks/bench_nvme.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BLOCK, DEPTH, PARTS = 1 << 20, 8, 16
PASSES = 5  # interleaved I/O passes per column (3 swung the ratio to fio by 0.74x-0.97x between runs)


def _apt(package: str, present) -> str | None:
    """None when ``present()`` (after an apt-get install if needed and possible), else why not."""
    if present():
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"{package} not installed (not root: cannot apt-get it)"
    proc = subprocess.run(["apt-get", "install", "-y", "-q", package], capture_output=True, text=True, timeout=600)
    return None if present() else f"{package} not installed (apt-get: {proc.stderr.strip()[-120:]})"


def fio_gbps(path: Path, mib: int, rw: str, engine: str = "libaio") -> float:
    """fio's GB/s (1e9 bytes) for one sequential pass; ``psync`` runs DEPTH threads of depth 1 over DEPTH ranges."""
    cmd = ["fio", "--name=zero", f"--filename={path}", f"--rw={rw}", f"--bs={BLOCK}", "--direct=1",
           "--output-format=json", f"--ioengine={engine}"]  # fmt: skip
    if engine == "psync":
        part = mib // DEPTH
        cmd += [f"--size={part}M", f"--numjobs={DEPTH}", f"--offset_increment={part}M", "--group_reporting", "--thread"]
    else:
        cmd += [f"--size={mib}M", f"--iodepth={DEPTH}"]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout)
    return out["jobs"][0]["write" if rw == "write" else "read"]["bw_bytes"] / 1e9


def _buffer(mib: int):
    from zero_kernels.aio import aligned_empty

    return aligned_empty((mib << 20) // PARTS // 4).fill_(1.0)


def _reserve(path: Path, mib: int) -> None:
    """A new file of ``mib`` MiB with its blocks reserved (unwritten), as fio lays a file out before its clock starts:
    every side's write pass then measures the same thing, writing into reserved space."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, mib << 20)
    finally:
        os.close(fd)


def ours_gbps(path: Path, mib: int, rw: str, engine: str = "kernel_aio") -> tuple[float, str]:
    """zero_kernels.aio: PARTS requests submitted, then waited; returns GB/s and the backend and engine (a write
    pass writes into a file ``_reserve`` laid out)."""
    from zero_kernels.aio import AioSettings, AsyncIO

    io = AsyncIO(AioSettings(block_size=BLOCK, queue_depth=DEPTH, engine=engine), str(path.parent))
    buf, part = _buffer(mib), (mib << 20) // PARTS
    start = time.perf_counter()
    submit = io.write if rw == "write" else io.read
    handles = [submit(buf, str(path), i * part) for i in range(PARTS)]
    for h in handles:
        io.wait(h)
    dt = time.perf_counter() - start
    io.close()
    return (mib << 20) / dt / 1e9, f"{io.backend} {io.engine}" + (" O_DIRECT" if io.direct else " page cache")


def _locked() -> str | None:
    """Why DeepSpeed's async_io cannot be loaded now: torch's build lock exists (a build in progress elsewhere, or a
    killed one, after which torch would wait forever)."""
    lock = Path(os.environ.get("TORCH_EXTENSIONS_DIR", ROOT / ".nox" / "torch_extensions")) / "async_io" / "lock"
    return f"DeepSpeed async_io not measured: its build lock {lock} exists (a build in progress or killed)" if (
        lock.exists()) else None  # fmt: skip


def _ds_handle():
    """DeepSpeed 0.19.8's async_io op with the same settings (built into TORCH_EXTENSIONS_DIR), or why not."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".nox" / "torch_extensions"))
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError as e:
        return None, f"DeepSpeed not importable ({e})"
    note = _apt("libaio-dev", lambda: Path("/usr/include/libaio.h").exists())
    if note:
        return None, note
    if _locked():
        return None, _locked()
    try:
        op = AsyncIOBuilder().load(verbose=False)
    except Exception as e:  # noqa: BLE001 - reported in the table's note
        return None, f"DeepSpeed async_io did not build: {str(e)[:160]}"
    return op.aio_handle(BLOCK, DEPTH, False, True, 1), None


def ds_gbps(handle, path: Path, mib: int, rw: str) -> float:
    """DeepSpeed's op, same pattern, from a buffer of its own page-locked allocator (else it copies through a bounce
    buffer: its best case is measured)."""
    import torch

    part = (mib << 20) // PARTS
    buf = handle.new_cpu_locked_tensor(part // 4, torch.empty(0, dtype=torch.float32)).fill_(1.0)
    start = time.perf_counter()
    for i in range(PARTS):
        (handle.async_pwrite if rw == "write" else handle.async_pread)(buf, str(path), i * part)
    handle.wait()
    dt = time.perf_counter() - start
    handle.free_cpu_locked_tensor(buf)
    return (mib << 20) / dt / 1e9


MEASURED: dict[str, float] = {}


def io_section(mib: int) -> str:
    folder = ROOT / ".nox" / "bench_io"
    folder.mkdir(parents=True, exist_ok=True)
    fio_note = _apt("fio", lambda: shutil.which("fio") is not None)
    handle, ds_note = _ds_handle()
    rows = ["| pattern (1 MiB blocks, queue depth 8) | zero_kernels aio GB/s | its thread-pool engine GB/s | fio "
            "libaio GB/s | DeepSpeed async_io GB/s | ours / fio | ours / DeepSpeed |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    engines = ["libaio", "io_uring", "psync"]
    choice = {e: {} for e in engines}
    backend = ""
    try:
        for rw in ("write", "read"):
            ours, pool, ds = [], [], []
            eng = {e: [] for e in engines}
            for _ in range(PASSES):  # interleaved: drift of the shared disk hits every column alike
                path = folder / "zero_io.bin"
                if rw == "write":
                    _reserve(path, mib)
                g, backend = ours_gbps(path, mib, rw)
                ours.append(g)
                ppath = folder / "zero_pool.bin"
                if rw == "write":
                    _reserve(ppath, mib)
                pool.append(ours_gbps(ppath, mib, rw, "threads")[0])
                if handle is not None:
                    dpath = folder / "ds_io.bin"
                    if rw == "write":
                        _reserve(dpath, mib)
                    ds.append(ds_gbps(handle, dpath, mib, rw))
                if fio_note is None:
                    for e in engines:
                        fpath = folder / f"fio_{e}.bin"
                        if rw == "write":
                            fpath.unlink(missing_ok=True)
                        eng[e].append(fio_gbps(fpath, mib, rw, e))
            o = statistics.median(ours)
            MEASURED[rw] = o
            f = statistics.median(eng["libaio"]) if eng["libaio"] else None
            d = statistics.median(ds) if ds else None
            for e in engines:
                choice[e][rw] = statistics.median(eng[e]) if eng[e] else None
            rows.append(f"| {rw} {mib} MiB | {o:.2f} | {statistics.median(pool):.2f} | {f and f'{f:.2f}' or '-'} | "
                        f"{d and f'{d:.2f}' or '-'} | "
                        f"{f and f'{o / f:.2f}x' or '-'} | {d and f'{o / d:.2f}x' or '-'} |")  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    notes = [n for n in (fio_note, ds_note) if n]
    load = os.getloadavg()[0]
    text = "\n".join(rows) + (
        f"\n\nEngine: {backend}; medians of {PASSES} interleaved passes; the disk and the 2 cores are shared with "
        f"other engineers' runs (load average {load:.0f} at the end). Same work on every side: each write pass "
        "writes a new file whose blocks were reserved before the clock starts (as fio lays its file out), reads "
        "read the file just written, all O_DIRECT, none fsyncs (O_DIRECT data is on the device when a request "
        "completes). Our engine and DeepSpeed's op move the same buffer (1/16 of the file, written or read 16 "
        "times), from zero_kernels.aio.aligned_empty: 2 MiB aligned and advised MADV_HUGEPAGE, so each request "
        "pins a few huge pages instead of 256 small ones (with 4 KiB pages the same run gave 2.16 / 1.22 GB/s, "
        "0.83x / 0.92x fio, on 2026-12-01); fio uses its own 4 KiB-page buffers (its huge-page option needs "
        "hugetlbfs pages reserved by root).")  # fmt: skip
    if notes:
        text += " " + "; ".join(notes) + "."
    if fio_note is None:
        text += ("\n\nThe engine choice (fio, same file size, 1 MiB blocks, total depth 8): io_uring and libaio with "
                 "depth 8 from one thread; psync with 8 threads of depth 1 (zero_kernels.aio's "
                 "`threads` engine; its default `kernel_aio` engine follows the libaio pattern).\n\n"
                 "| fio engine | write GB/s | read GB/s |\n|---|---|---|\n")  # fmt: skip
        text += "\n".join(f"| {e} | {choice[e]['write']:.2f} | {choice[e]['read']:.2f} |" for e in engines)
    return text


def _triad_gbps(numel: int) -> float:
    """STREAM triad (a = b + 2c, 12 bytes per element) with torch's threads: the memory bandwidth that bounds Adam."""
    import torch

    x, y, out = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        torch.add(x, y, alpha=2.0, out=out)
        ts.append(time.perf_counter() - t0)
    return 12 * numel / statistics.median(ts) / 1e9


def nvme_step_section(numel: int, sub: int, threads: int) -> str:
    """The pipelined NVMe optimizer step vs max(disk time at the bandwidth measured above, in-memory CPU Adam).

    Both optimizers get a fresh gradient before every timed step; a check outside the timing asserts that the
    in-memory step changed every master element (so no sub-group is skipped), and the NVMe step's bytes come from
    the I/O engine's counters."""
    import tempfile

    import torch

    from zero_kernels.aio import AioSettings, AsyncIO
    from zero_offload import HostOptimizer, NVMeOptimizer, SwapFolder, swap_bytes

    torch.set_num_threads(threads)
    root = ROOT / ".nox" / "bench_io"
    root.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root)
    try:
        master = torch.randn(numel)
        user = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        host = HostOptimizer([master], [0], user, sub_group_size=sub)
        folder = SwapFolder(tmp, 0, swap_bytes([numel], sub))
        io = AsyncIO(AioSettings(block_size=BLOCK, queue_depth=DEPTH), str(folder.path))
        nvme = NVMeOptimizer([master], [0], user, folder=folder, io=io, sub_group_size=sub, buffer_count=3)
        grad = torch.randn(numel)
        t_host, t_nvme, moved = [], [], []
        for i in range(5):  # interleaved; the first pair is a warm-up
            r0, w0 = io.bytes_read, io.bytes_written
            host.receive_grad(0, 0, grad)
            # timed from the NVMe optimizer's gradient (its reads start there; in training: as backward begins) to
            # its last write landed (the step leaves its writes in flight; here nothing would overlap them)
            t0 = time.perf_counter()
            nvme.receive_grad(0, 0, grad)
            t_grad = time.perf_counter() - t0
            before = host.master_view(0).clone() if i == 0 else None
            t0 = time.perf_counter()
            host.step(1.0)
            t_host.append(time.perf_counter() - t0)
            if before is not None and (changed := (host.master_view(0) != before).double().mean().item()) < 0.999:
                raise RuntimeError(f"bench nvme: the in-memory Adam step changed only {changed:.1%} of the masters")
            t0 = time.perf_counter()
            nvme.step(1.0)
            nvme.flush()
            t_nvme.append(t_grad + time.perf_counter() - t0)
            moved.append((io.bytes_read - r0, io.bytes_written - w0))
        nvme.close()
        triad = _triad_gbps(numel)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    th, tn = statistics.median(t_host[1:]), statistics.median(t_nvme[1:])
    read_b, write_b = moved[-1]
    w, r = MEASURED.get("write"), MEASURED.get("read")
    disk = read_b / (r * 1e9) + write_b / (w * 1e9) if w and r else None
    bound = max(th, disk) if disk else th
    dcol = f"{disk:.3f}" if disk else "-"
    return (f"| {numel / 1e6:.0f}M | {-(-numel // sub)} x 3 | {threads} | {th:.3f} | {28 * numel / th / 1e9:.0f} | "
            f"{triad:.0f} | {read_b / 2**20:.0f} + {write_b / 2**20:.0f} | {dcol} | {tn:.3f} | "
            f"{tn / bound:.2f}x |")  # fmt: skip


NVME_STEP_HEADER = ("| elements | sub-groups x buffers | threads | in-memory CPU Adam s | Adam GB/s (28 B/element) | "
                    "triad GB/s | MiB read + written per NVMe step | disk time s | NVMe step s | ratio vs max(disk, "
                    "Adam) |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip


def run_training(impl: str, size: str, steps: int, workdir: Path, tag: str = "") -> dict | str:
    out, nvme = workdir / f"{impl}{tag}", workdir / f"{impl}{tag}-swap"
    nvme.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(HERE / "nvme_worker.py"),
           "--impl", impl, "--size", size, "--steps", str(steps), "--nvme-path", str(nvme),
           "--out", str(out)]  # fmt: skip
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".nox" / "torch_extensions"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        tail = [ln for ln in lines if ln.startswith("[rank") and "Error" in ln] or [
            ln for ln in lines if "Error" in ln or "error" in ln] or ["failed"]  # fmt: skip
        return f"exit {proc.returncode}: {tail[-1][:200]}"
    return json.loads((out / "rank0.json").read_text())


def training_section(size: str, steps: int, rounds: int = 1) -> str:
    """``rounds`` runs of each impl, interleaved (DeepSpeed, zero, DeepSpeed, ...): each run's steps after its first
    are pooled, and the table gives their medians (one run's four steps swung 10% between runs here)."""
    import tempfile

    workdir = Path(tempfile.mkdtemp(prefix="zero-bench-nvme-", dir=ROOT / ".nox"))
    res: dict = {}
    try:
        for k in range(rounds):
            for impl in ("deepspeed", "zero"):
                if isinstance(res.get(impl), str):
                    continue
                r = _locked() if impl == "deepspeed" and _locked() else run_training(impl, size, steps, workdir,
                                                                                     f"-{k}")  # fmt: skip
                if not isinstance(r, dict):
                    res[impl] = r
                elif impl not in res:
                    res[impl] = dict(r, step_s=r["step_s"][1:], opt_s=r["opt_s"][1:])
                else:
                    res[impl]["step_s"] += r["step_s"][1:]
                    res[impl]["opt_s"] += r["opt_s"][1:]
                    res[impl]["peak_rss_bytes"] = max(res[impl]["peak_rss_bytes"], r["peak_rss_bytes"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows = ["| impl | median s/step | median optimizer step s | step ratio vs DeepSpeed | optimizer step ratio | "
            "peak RSS/rank MiB | first losses |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    ds = res["deepspeed"]

    def med(xs):
        return statistics.median(xs)

    for impl, r in res.items():
        if not isinstance(r, dict):
            rows.append(f"| {impl} | failed: {r} | | | | | |")
            continue
        ok = isinstance(ds, dict)
        vs = f"{med(r['step_s']) / med(ds['step_s']):.2f}x" if ok else ""
        vs_opt = f"{med(r['opt_s']) / med(ds['opt_s']):.2f}x" if ok else ""
        losses = ", ".join(f"{x:.4f}" for x in r["losses"][:3])
        rows.append(f"| {impl} | {med(r['step_s']):.3f} | {med(r['opt_s']):.3f} | {vs} | {vs_opt} | "
                    f"{r['peak_rss_bytes'] / 2**20:.0f} | {losses} |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> str:
    """Run the nvme section; return markdown."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-training", action="store_true")
    args = ap.parse_args(argv)
    mib = 256 if args.quick else 1024
    parts = [f"### Async I/O engine vs fio and DeepSpeed's async_io ({mib} MiB file, O_DIRECT)", io_section(mib)]
    numel = 16_000_000 if args.quick else 48_000_000
    rows = [nvme_step_section(numel, 4_000_000, t) for t in (1, 2)]
    parts += ["### Pipelined NVMe optimizer step (sub-groups of 4M elements, buffer_count 3, read and write pipelined)",
              "\n".join([NVME_STEP_HEADER, *rows]),
              "Medians of 4 steps after a warm-up, the in-memory and NVMe steps interleaved, each after a fresh "
              "gradient; the NVMe step is timed from its gradient (which starts its reads; in training they start as "
              "backward begins) until its last write has landed (in training the writes land during the next "
              "forward). Disk time = the bytes the I/O engine counted in one NVMe step (both Adam moments, 8 bytes per "
              "element each way: with fp32 storage the master is the host copy of the updated shard; a 16-bit "
              "storage dtype adds the master's 4) read at the read GB/s plus written at the write GB/s above; the "
              "bound is the larger of disk time and the in-memory CPU Adam step of the same elements (target <= "
              "1.15x). The in-memory step is checked (outside the timing) to change every master element. Adam GB/s"
              " counts 28 bytes per element (read master, gradient, 2 moments; write master, 2 moments) and the "
              "triad 12, both measured in this process: Adam is memory-bound, so its GB/s near or above the triad's"
              " (the write-allocate traffic the triad convention leaves out) says the step time is real; on this "
              "CPU it is far below the disk time, so the disk is the bound."]  # fmt: skip
    if not args.skip_training:
        steps = 3 if args.quick else 5
        table = training_section("20m", steps, 1 if args.quick else 3)
        parts += [f"### Training step, Llama 20m, stage 3, optimizer state on NVMe, 2 gloo ranks x 1 thread, {steps} "
                  "steps: zero vs DeepSpeed 0.19.8 (same config)", table,
                  "Config of both: AdamW, no clipping, `offload_optimizer` {device nvme, buffer_count 12, "
                  "pipeline_read and pipeline_write true}, sub_group_size 4M, `aio` {1 MiB blocks, queue depth 8, 1 "
                  "thread, overlap_events}. buffer_count 12 because DeepSpeed 0.19.8's pipelined swapper runs out of "
                  "buffers with fewer: with 4 its first step fails on `assert new_alloc_buffers is not None` "
                  "(deepspeed/runtime/swap_tensor/pipelined_optimizer_swapper.py:219), with 8 a swap-in fails with "
                  "\"PipelinedOptimizerSwapper ran out of swap buffers\" (line 253; the bench used 4 until now, hence"
                  " its earlier 'failed' row). Medians over 3 interleaved runs of each (1 with --quick), without each"
                  " run's first step. DeepSpeed removes its swap folder at start-up and allocates its swap buffers up"
                  " front (baselines.md)."]  # fmt: skip
    parts += ["### The big-model job (recorded, not re-run by this bench: about 7 minutes)",
              "`zero train --model-size 560m --config packages/zero-offload/examples/llama_nvme_big.json --steps 5 "
              "--offload nvme --nproc-per-node 1 --no-checkpoint`, 1 rank, stage 3, fp32 AdamW, parameters and "
              "optimizer state on NVMe with streamed gradients (2026-11-30 23:51 UTC, same machine, load ~10 from "
              "other engineers' tests): 567,089,664 parameters, fp32 model states 8653 MiB; peak RSS 1756 MiB during "
              "the steps, 1798 MiB for the whole process: **4.81x** (the goal: >= 4x); 56.6 s per step (median of 5; "
              "`engine.step()` 9.2-14.6 s); validation loss 5.93 -> 3.78. The earlier 120m run (2 ranks, optimizer "
              "state only on NVMe) was 0.25x. Peak RSS against its formula: the `nvme_rss` section; the accounting is "
              "in packages/zero-offload/README.md."]  # fmt: skip
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    print(main(sys.argv[1:]))

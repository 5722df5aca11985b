"""Count the Python functions, files and calls of a steady stage-3 training step: zero's ``ZeroRuntime`` and
PyTorch's FSDP2.

One way for both: a 3-layer MLP on 2 gloo ranks, one unit per layer (zero: ``stage3_param_persistence_threshold``
0, so every parameter is sharded), two warm-up steps, then ``sys.setprofile`` records every Python function entered
during the third step (forward, backward, optimizer step) whose file lies in the library's own source, on rank 0:
``zero_core`` and ``zero_comm`` for zero (its collectives are its own), ``torch/distributed/fsdp`` for FSDP2. Calls
counts every entry (a function entered ten times counts ten).

Usage: python tools/step_path.py [--list]   (one line per library: functions, files, calls; --list names them)
"""

from __future__ import annotations

import sys

import torch

from zero_comm.testing import run_ranks

DIM, LAYERS = 64, 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM) for _ in range(LAYERS)])


def _profiled(step, marks: tuple[str, ...]) -> dict[tuple[str, str], int]:
    """(file, function) -> calls during ``step()``, for files whose path holds one of ``marks``."""
    calls: dict[tuple[str, str], int] = {}

    def prof(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename.replace("\\", "/")
            if any(m in path for m in marks):
                key = (path, frame.f_code.co_qualname)
                calls[key] = calls.get(key, 0) + 1

    sys.setprofile(prof)
    try:
        step()
    finally:
        sys.setprofile(None)
    return dict(sorted(calls.items()))


def _zero() -> dict[tuple[str, str], int]:
    from zero_core import ZeroConfig, ZeroRuntime

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=0)
    rt = ZeroRuntime(model, opt, cfg)
    x = torch.randn(8, DIM)

    def step():
        loss = model(x).square().mean()
        rt.backward(loss)
        rt.step()
        rt.zero_grad()

    for _ in range(2):
        step()
    out = _profiled(step, ("/zero_core/", "/zero_comm/"))
    rt.close()
    return out


def _fsdp2() -> dict[tuple[str, str], int]:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(8, DIM)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    return _profiled(step, ("/torch/distributed/fsdp/",))


def main() -> None:
    for name, fn in (("zero stage 3", _zero), ("FSDP2", _fsdp2)):
        seen = run_ranks(fn, 2, timeout=300)[0]
        files = len({p for p, _ in seen})
        print(f"{name}: {len(seen)} functions in {files} files, {sum(seen.values())} calls")
        if "--list" in sys.argv:
            for (path, function), calls in seen.items():
                print(f"  {path.rsplit('/site-packages/', 1)[-1].rsplit('/src/', 1)[-1]}: {function} x{calls}")


if __name__ == "__main__":
    main()

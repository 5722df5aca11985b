"""Count the functions and files of a steady stage-3 training step: zero's ``ZeroRuntime`` and PyTorch's FSDP2.

One way for both: a 4-layer MLP on 2 gloo ranks, one unit per layer, two warm-up steps, then ``sys.setprofile``
records every Python function entered during the third step (forward, backward, optimizer step) whose file lies in
the library's own source (``zero_core`` for zero; ``torch/distributed/fsdp`` for FSDP2: neither counts its
collectives library), on rank 0.

Usage: python tools/step_path.py [--list]   (one line per library: functions, files; --list names them)
"""

from __future__ import annotations

import sys

import torch

from zero_comm.testing import run_ranks

DIM, LAYERS = 64, 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM) for _ in range(LAYERS)])


def _profiled(step, marks: tuple[str, ...]) -> list[tuple[str, str]]:
    seen: set[tuple[str, str]] = set()

    def prof(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename.replace("\\", "/")
            if any(m in path for m in marks):
                seen.add((path, frame.f_code.co_qualname))

    sys.setprofile(prof)
    try:
        step()
    finally:
        sys.setprofile(None)
    return sorted(seen)


def _zero() -> list[tuple[str, str]]:
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
    out = _profiled(step, ("/zero_core/",))  # the collectives are not counted, as torch.distributed for FSDP2
    rt.close()
    return out


def _fsdp2() -> list[tuple[str, str]]:
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
        print(f"{name}: {len(seen)} functions in {len({p for p, _ in seen})} files")
        if "--list" in sys.argv:
            for path, function in seen:
                print(f"  {path.rsplit('/site-packages/', 1)[-1].rsplit('/src/', 1)[-1]}: {function}")


if __name__ == "__main__":
    main()

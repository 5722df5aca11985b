"""Stage-3 parameters: torch functions on a gathered one run no Python, an in-place write into a released one raises
``PartitionedWriteError`` naming it, and the ``ds_*`` properties answer in both states."""

import sys

import torch
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import GatheredParameters, ZeroConfig, ZeroRuntime, zero_init
from zero_core.partitioned_param import PartitionedWriteError, ReleasedZeroParameter, ZeroParameter
from zero_core.shard_state import ZeroParamStatus


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))


def _torch_function_frames(step) -> list[str]:
    """Python ``__torch_function__`` frames entered during ``step()`` (qualified names)."""
    seen = []

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "__torch_function__":
            seen.append(frame.f_code.co_qualname)

    sys.setprofile(prof)
    try:
        step()
    finally:
        sys.setprofile(None)
    return seen


def _guard_body(built_under_zero_init: bool) -> dict:
    with zero_init(enabled=built_under_zero_init):
        model = _model()
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     ZeroConfig(stage=3, stage3_param_persistence_threshold=0))  # fmt: skip
    w = model[2].weight
    x = torch.linspace(-1, 1, 12).view(2, 6)
    inside = []  # (class, torch function, status, shape) of the second layer's weight during its forward
    model[2].register_forward_pre_hook(
        lambda m, a: inside.append((type(w), type(w).__torch_function__, w.ds_status, tuple(w.ds_shape)))
    )

    def step():
        rt.backward(rt.module(x).square().mean())
        rt.step()

    step()  # the first pass records the unit order (and checks released reads)
    frames = _torch_function_frames(step)
    before = rt.full_parameters()
    released = (type(w), isinstance(w, ZeroParameter), w.ds_status, tuple(w.ds_shape), w.ds_numel, w.numel())
    errors = []
    for write in (lambda: w.fill_(1.0), lambda: nn.init.zeros_(model[0].bias), lambda: w.add_(1.0)):
        try:
            with torch.no_grad():
                write()
        except PartitionedWriteError as e:
            errors.append(str(e))
    with GatheredParameters([w]):
        gathered = (type(w), w.ds_status, w.numel(), float(w.detach().abs().sum()) > 0)
    after = type(w)
    kept = all(torch.equal(v, before[k]) for k, v in rt.full_parameters().items())
    return {"inside": inside, "frames": frames, "released": released, "errors": errors, "gathered": gathered,
            "after": after, "ds_id": w.ds_id, "kept": kept}  # fmt: skip


def test_gathered_parameters_run_no_python_on_torch_functions_and_released_writes_raise():
    for built_under_zero_init in (False, True):
        for out in run_ranks(_guard_body, 2, built_under_zero_init, timeout=120):
            # while its unit is gathered the parameter is a ZeroParameter with torch's own (disabled) hook
            for cls, fn, status, shape in out["inside"]:
                assert cls is ZeroParameter and fn is torch._C._disabled_torch_function_impl
                assert status is ZeroParamStatus.AVAILABLE and shape == (4, 8)
            assert len(out["inside"]) == 2
            # a steady step (forward, backward, step) enters no Python __torch_function__ at all
            assert out["frames"] == []
            # released: the guarded subclass, still a ZeroParameter reading its full shape
            assert out["released"] == (ReleasedZeroParameter, True, ZeroParamStatus.NOT_AVAILABLE, (4, 8), 32, 0)
            assert len(out["errors"]) == 3
            assert "'2.weight'" in out["errors"][0] and "fill_" in out["errors"][0] and "(4, 8)" in out["errors"][0]
            assert "'0.bias'" in out["errors"][1] and "zero_ " in out["errors"][1]
            assert "'2.weight'" in out["errors"][2] and "GatheredParameters" in out["errors"][2]
            assert out["gathered"] == (ZeroParameter, ZeroParamStatus.AVAILABLE, 32, True)
            assert out["after"] is ReleasedZeroParameter
            assert isinstance(out["ds_id"], int)
            assert out["kept"]  # the refused writes changed nothing

"""Reading the weights after ZeRO-3 training, compiled or eager, as the compile tutorials do: train, then gather.

A user trains a small MLP (``Linear(8, 13) -> ReLU -> Linear(13, 7)``: units that 2 ranks do not divide) at stage
3 with every parameter sharded, AdamW, micro-batch 2 x accumulation 2, 4 steps of cross-entropy, with
``compile.deepcompile`` under the default backend (inductor) and under aot_eager, and without compiling. Then every
way of reading a parameter must see its full value or hold no elements, never freed memory (which killed both
ranks with SIGSEGV): ``GatheredParameters``, a tensor kept from inside that block and read after it,
``module.state_dict()``, ``_zero3_consolidated_16bit_state_dict``, ``safe_get_full_fp32_param`` and
``save_16bit_model``. Each full value equals a single-process PyTorch AdamW run on the same batches (1e-5 relative)
on every rank. An edit made inside ``GatheredParameters(modifier_rank=0)`` persists on every rank and training
goes on.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from zero_comm.testing import run_ranks

STEPS, ACC, MICRO, LR, WD = 4, 2, 2, 1e-2, 0.01
MODES = ("inductor", "aot_eager", "eager")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.ReLU(), torch.nn.Linear(13, 7))


def _data(world: int):
    """``[step][micro] -> (x, y)`` holding every rank's rows: rank r takes rows ``[r * MICRO, (r + 1) * MICRO)``."""
    g = torch.Generator().manual_seed(3)
    return [[(torch.randn(world * MICRO, 8, generator=g), torch.randint(0, 7, (world * MICRO,), generator=g))
             for _ in range(ACC)] for _ in range(STEPS)]  # fmt: skip


def _reference(world: int) -> dict[str, torch.Tensor]:
    """One process: each step averages the gradients of every rank's micro-batches, then AdamW steps."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in _data(world):
        opt.zero_grad()
        for x, y in step:
            for r in range(world):
                rows = slice(r * MICRO, (r + 1) * MICRO)
                (torch.nn.functional.cross_entropy(model(x[rows]), y[rows]) / (ACC * world)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_and_read(mode: str, root: str) -> dict:
    import zero
    from zero.utils import safe_get_full_fp32_param

    torch._dynamo.reset()  # warm workers are reused across tests
    rank = dist.get_rank()
    model = _model()
    compile_section = {"deepcompile": False} if mode == "eager" else {"deepcompile": True}
    if mode == "aot_eager":
        compile_section["backend"] = "aot_eager"
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACC, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_gather_16bit_weights_on_model_save": True},
           "compile": compile_section}  # fmt: skip
    engine, *_ = zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    for step in _data(dist.get_world_size()):
        for x, y in step:
            engine.backward(torch.nn.functional.cross_entropy(engine(x[rows]), y[rows]))
            engine.step()
    out: dict = {}
    params = list(engine.module.parameters())
    with zero.GatheredParameters(params):
        out["gathered"] = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
        kept = {n: p.detach() for n, p in engine.module.named_parameters()}
    out["kept"] = {n: t.float().clone() for n, t in kept.items()}  # read after the block released the units
    state = engine.module.state_dict()
    out["state_dict_numel"] = {k: v.numel() + 0 * float(v.float().sum()) for k, v in state.items()}  # reads them
    out["consolidated"] = {k: v.float() for k, v in engine._zero3_consolidated_16bit_state_dict().items()}
    out["fp32"] = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    path = os.path.join(root, mode)
    assert engine.save_16bit_model(path, "model.bin")
    out["saved"] = {k: v.float() for k, v in torch.load(os.path.join(path, "model.bin")).items()}
    bias = engine.module[2].bias
    with zero.GatheredParameters([bias], modifier_rank=0):
        if rank == 0:
            bias.data.fill_(0.25)
    out["edited"] = safe_get_full_fp32_param(bias)
    for x, y in _data(dist.get_world_size())[0]:  # one more optimizer step
        engine.backward(torch.nn.functional.cross_entropy(engine(x[rows]), y[rows]))
        engine.step()
    with zero.GatheredParameters([bias]):
        out["bias_after_step"] = bias.detach().clone()
    engine.destroy()
    return out


def _all_modes(root: str) -> dict:
    return {mode: _train_and_read(mode, root) for mode in MODES}


def test_every_read_after_stage3_training_sees_the_full_weights_compiled_or_eager(tmp_path):
    ref = _reference(2)
    for rank, by_mode in enumerate(run_ranks(_all_modes, 2, str(tmp_path), timeout=900)):
        for mode, out in by_mode.items():
            where = f"{mode}, rank {rank}"
            reads = {"GatheredParameters": out["gathered"], "a tensor kept from the block": out["kept"],
                     "safe_get_full_fp32_param": out["fp32"]}  # fmt: skip
            if rank == 0:
                reads |= {"consolidated state dict": out["consolidated"], "save_16bit_model": out["saved"]}
            else:
                assert out["consolidated"] == {}, where
            for how, got in reads.items():
                assert got.keys() == ref.keys(), f"{where}: {how}"
                for k in ref:
                    torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=f"{where}: {how}: {k}")
            # released parameters read as empty tensors, never as a full shape over freed memory
            assert set(out["state_dict_numel"].values()) == {0}, (where, out["state_dict_numel"])
            torch.testing.assert_close(out["edited"], torch.full((7,), 0.25), msg=where)
            assert out["bias_after_step"].shape == (7,) and bool(torch.isfinite(out["bias_after_step"]).all()), where
            assert not torch.equal(out["bias_after_step"], torch.full((7,), 0.25)), f"{where}: no step after edit"

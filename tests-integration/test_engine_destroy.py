"""Issue 12 item 3 through the engine: ``engine.destroy()`` (DeepSpeed's name) leaves a plain module holding the
trained values, removes every hook, frees the engine, and 50 initialize/destroy cycles grow nothing."""

import gc
import weakref

import pytest
import torch

from zero_comm.testing import run_ranks


def _cfg(stage):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "steps_per_print": 1000,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}  # fmt: skip


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.GELU(), torch.nn.Linear(13, 7))


def _hooks(module):
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_state_dict_hooks")
    left = [f"{n}.{k}" for n, m in module.named_modules() for k in kinds if getattr(m, k, None)]
    return left + [n for n, p in module.named_parameters() if getattr(p, "_post_accumulate_grad_hooks", None)]


def _body(stage, cycles):
    import zero

    x = torch.linspace(-1, 1, 16).view(2, 8)
    results, refs = [], []
    for i in range(cycles):
        model = _net()
        engine, *_ = zero.initialize(model=model, config=_cfg(stage))
        for _ in range(2):
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
        with torch.no_grad():
            last = engine(x).clone()
        engine.destroy()
        refs.append(weakref.ref(engine))
        if i == 0:
            with torch.no_grad():
                results.append((torch.equal(model(x), last), _hooks(model)))
        del engine, model
        if i in (4, cycles - 1):
            gc.collect()
            results.append(len(gc.get_objects()))
    return results, sum(r() is not None for r in refs)


@pytest.mark.parametrize("stage", [1, 3])
def test_engine_destroy_leaves_a_plain_module_and_frees_everything(stage):
    for ((same, hooks), after5, after50), alive in run_ranks(_body, 2, stage, 50, timeout=300):
        assert same and hooks == []
        assert alive == 0  # every engine was freed
        assert after50 - after5 < 100  # 45 more cycles left no per-cycle garbage behind

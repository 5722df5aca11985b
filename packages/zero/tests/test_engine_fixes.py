"""Engine integration: gradient accumulation boundary passed to zero_core (several backward calls before one step
keep every micro-batch), a client LR scheduler in checkpoints, inputs cast to the compute dtype, save_16bit_model
writing every state-dict key."""

import os

import pytest
import torch

import zero
from zero.engine.precision import announce, precision_policy
from zero_comm.testing import run_ranks


class BufNet(torch.nn.Module):
    """TinyNet-sized layers plus buffers (BatchNorm: float and integer) and a tied embedding/output weight."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(13, 8)
        self.fc = torch.nn.Linear(8, 13)
        self.bn = torch.nn.BatchNorm1d(13)
        self.out = torch.nn.Linear(13, 8, bias=False)
        self.head = torch.nn.Linear(8, 13, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter under two state-dict keys

    def forward(self, x):
        return self.head(self.out(self.bn(torch.nn.functional.gelu(self.fc(x)))))


def _tiny():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.GELU(), torch.nn.Linear(13, 7), torch.nn.GELU(),
                               torch.nn.Linear(7, 4))  # fmt: skip


def _x(i, rank=0, n=3):
    return torch.rand(n, 8, generator=torch.Generator().manual_seed(100 * i + rank)) * 2 - 1


# --- 1. save_16bit_model ------------------------------------------------------------------------------------------
def save16_body(stage: int, out: str, filename: str) -> dict:
    torch.manual_seed(1234)
    model = BufNet()
    cfg = {"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}}  # fmt: skip
    engine, *_ = zero.initialize(model=model, config=cfg)
    rank = torch.distributed.get_rank()
    for i in range(2):
        engine.backward(engine(_x(i, rank)).square().mean())
        engine.step()
    saved = engine.save_16bit_model(out, filename)
    full = {k: v.clone() for k, v in engine.runtime.full_parameters().items()}
    buffers = {k: v.clone() for k, v in engine.module.named_buffers()}
    engine.eval()
    x = _x(9)
    with torch.no_grad():
        y = engine(x)
    return {"saved": saved, "full": full, "buffers": buffers, "x": x, "y": y}


@pytest.mark.parametrize(("stage", "filename"), [(0, "model.safetensors"), (3, "model.safetensors"),
                                                 (3, "pytorch_model.bin")])  # fmt: skip
def test_save_16bit_model_writes_every_key_and_loads_strictly(tmp_path, stage, filename):
    res = run_ranks(save16_body, 2, stage, str(tmp_path), filename, timeout=90)
    r0 = res[0]
    assert all(r["saved"] is True for r in res)  # DeepSpeed's return value
    assert sorted(os.listdir(tmp_path)) == [filename]  # no temp file left, nothing else written
    if filename.endswith(".bin"):
        state = torch.load(tmp_path / filename, weights_only=True)
    else:
        from safetensors.torch import load_file

        state = load_file(str(tmp_path / filename))
    plain = BufNet()
    assert set(state) == set(plain.state_dict())  # buffers and both tied keys included
    plain.load_state_dict(state, strict=True)
    for name, value in r0["full"].items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0)
    torch.testing.assert_close(state["head.weight"], state["emb.weight"], rtol=0, atol=0)
    for name, value in r0["buffers"].items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0)
    assert state["bn.num_batches_tracked"].item() == 2
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(r0["x"]), r0["y"], rtol=1e-6, atol=1e-6)


def save16_frozen_body(out: str) -> None:
    model = _tiny()
    model[0].requires_grad_(False)
    cfg = {"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
           "bf16": {"enabled": True}}  # fmt: skip
    engine, *_ = zero.initialize(model=model, config=cfg)
    engine.save_16bit_model(out, "w.safetensors", exclude_frozen_parameters=True)


def test_save_16bit_model_bf16_without_frozen(tmp_path):
    from safetensors.torch import load_file

    run_ranks(save16_frozen_body, 2, str(tmp_path), timeout=60)
    state = load_file(str(tmp_path / "w.safetensors"))
    assert sorted(state) == ["2.bias", "2.weight", "4.bias", "4.weight"]
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    ref = _tiny().state_dict()
    torch.testing.assert_close(state["2.weight"], ref["2.weight"].bfloat16(), rtol=0, atol=0)


# --- 2. gradient accumulation boundary -----------------------------------------------------------------------------
def boundary_flags_body() -> list:
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 3,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1}}  # fmt: skip
    engine, *_ = zero.initialize(model=_tiny(), config=cfg)
    seen = []
    inner = engine.runtime.backward

    def spy(loss, *, is_boundary=None, **kw):
        seen.append(is_boundary)
        return inner(loss, is_boundary=is_boundary, **kw)

    engine.runtime.backward = spy
    for i in range(4):
        engine.backward(engine(_x(i)).sum())
        engine.step()
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(engine(_x(5)).sum())
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(_x(6)).sum())
    return seen


def test_engine_passes_the_boundary_to_zero_core():
    assert run_ranks(boundary_flags_body, 1, timeout=60)[0] == [False, False, True, False, False, True]


def several_backwards_body(stage: int, explicit: bool) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}}  # fmt: skip
    engine, *_ = zero.initialize(model=_tiny(), config=cfg)
    rank = torch.distributed.get_rank()
    for k in range(4):
        if explicit:
            engine.set_gradient_accumulation_boundary(k == 3)
        engine.backward(torch.nn.functional.mse_loss(engine(_x(k, rank)), torch.zeros(3, 4)))
    engine.step()
    return {"params": engine.runtime.full_parameters(), "steps": engine.global_steps}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("explicit", [False, True])
def test_several_backwards_before_one_step_keep_every_micro_batch(stage, explicit):
    ref = _tiny()
    total = sum(torch.nn.functional.mse_loss(ref(_x(k, r)), torch.zeros(3, 4)) for k in range(4) for r in (0, 1))
    (total / 2).backward()  # rank average of each backward, summed over backwards (zero_core's documented rule)
    with torch.no_grad():
        expected = {n: p - 0.1 * p.grad for n, p in ref.named_parameters()}
    for out in run_ranks(several_backwards_body, 2, stage, explicit, timeout=60):
        assert out["steps"] == 1
        for n, value in expected.items():
            torch.testing.assert_close(out["params"][n], value, rtol=1e-5, atol=1e-6)


# --- 5. client LR scheduler in checkpoints -------------------------------------------------------------------------
def sched_body(ckpt: str, phase: str) -> dict:
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    cfg = {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 2}}
    engine, _, _, lr_sched = zero.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    assert lr_sched is sched
    rank = torch.distributed.get_rank()
    if phase == "resume":
        engine.load_checkpoint(ckpt)
    else:
        for i in range(3):
            engine.backward(engine(_x(i, rank)).square().mean())
            engine.step()
        engine.save_checkpoint(ckpt)
    restored = {"last_epoch": sched.last_epoch, "lr": engine.get_lr()[0]}
    lrs = []
    for i in range(3, 6):
        engine.backward(engine(_x(i, rank)).square().mean())
        engine.step()
        lrs.append(engine.get_lr()[0])
    return {"restored": restored, "lrs": lrs, "params": engine.runtime.full_parameters()}


def test_client_lr_scheduler_is_saved_and_restored(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    straight = run_ranks(sched_body, 2, ckpt, "train", timeout=90)
    resumed = run_ranks(sched_body, 2, ckpt, "resume", timeout=90)
    for a, b in zip(straight, resumed):
        assert b["restored"] == a["restored"] == {"last_epoch": 3, "lr": pytest.approx(0.05)}
        assert b["lrs"] == a["lrs"] == pytest.approx([0.025, 0.025, 0.0125])
        for n in a["params"]:
            torch.testing.assert_close(b["params"][n], a["params"][n], rtol=0, atol=0)


# --- 3. precision: inputs cast to the compute dtype ----------------------------------------------------------------
def cast_body(stage: int) -> dict:
    seen = {}

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x, ids, extra=None):
            seen.update(x=x.dtype, ids=ids.dtype, extra=extra["t"].dtype, w=self.fc.weight.dtype)
            return self.fc(x).float().sum() + ids.sum() * 0

    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # fmt: skip
    engine, *_ = zero.initialize(model=Probe(), config=cfg)
    loss = engine(torch.rand(2, 8), torch.arange(2), extra={"t": torch.rand(2, dtype=torch.float64)})
    engine.backward(loss)
    engine.step()
    return {"seen": seen, "compute": engine.runtime.precision.compute}


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_inputs_follow_the_compute_dtype(stage):
    expected = precision_policy(zero.load_config({"train_batch_size": 2, "bf16": {"enabled": True}}), "cpu").compute
    out = run_ranks(cast_body, 2, stage, timeout=60)[0]
    assert out["compute"] == expected
    assert out["seen"] == {"x": expected, "ids": torch.int64, "extra": expected, "w": expected}


def test_fp32_compute_is_announced_once(capsys):
    import zero.engine.precision as prec

    prec._announced.clear()
    policy = precision_policy(zero.load_config({"train_batch_size": 2, "bf16": {"enabled": True}}), "cpu",
                              frozenset({"avx2"}))  # fmt: skip
    announce(policy, "cpu", 0)
    announce(policy, "cpu", 0)
    announce(policy, "cpu", 1)
    out = capsys.readouterr().out
    assert out.count("compute in fp32, bfloat16 for parameter storage and communication") == 1


# --- 4. activation_checkpointing: plain recomputation with zero.checkpointing ----------------------------------------
class Recompute(torch.nn.Module):
    def __init__(self, use_checkpoint: bool):
        super().__init__()
        torch.manual_seed(1234)
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.GELU(), torch.nn.Linear(13, 7))
        self.head = torch.nn.Linear(7, 4)
        self.use_checkpoint = use_checkpoint

    def forward(self, x):
        h = zero.checkpointing.checkpoint(self.block, x) if self.use_checkpoint else self.block(x)
        return self.head(torch.nn.functional.gelu(h))


def recompute_body(use_checkpoint: bool) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False}}  # fmt: skip
    engine, *_ = zero.initialize(model=Recompute(use_checkpoint), config=cfg)
    rank = torch.distributed.get_rank()
    for i in range(2):
        engine.backward(engine(_x(i, rank)).square().mean())
        engine.step()
    return engine.runtime.full_parameters()


def test_activation_recompute_at_stage3_matches_plain_backward():
    plain = run_ranks(recompute_body, 2, False, timeout=60)
    ckpt = run_ranks(recompute_body, 2, True, timeout=60)
    for a, b in zip(plain, ckpt):
        assert a.keys() == b.keys()
        for n in a:
            torch.testing.assert_close(b[n], a[n], rtol=1e-6, atol=1e-7)
        assert not torch.equal(a["block.0.weight"], Recompute(False).block[0].weight.detach())  # it trained

"""DeepSpeed's ``data_types`` section: every key accepted, ``grad_accum_dtype`` honoured at stages 0-3 (fp32 is the
default run bitwise; bf16 accumulates in bf16 buffers of half the bytes), ``communication_data_type: fp32`` with
bf16 reducing in fp32 exactly, ``buffer_dtype`` / ``keep_in_fp32_modules`` applied to buffers, bad mixes refused."""

import pytest
import torch

import zero
from zero.config import ConfigError, load_config
from zero_comm.testing import run_ranks

GAS = 8
SMALL = 2.0**-9  # micro-batches 2-8: a gradient a quarter of bf16's spacing at the first micro-batch's 1/8


class OneWeight(torch.nn.Module):
    """``loss = (w * x).sum()`` with ``w`` four zeros: the gradient of every element is ``x``."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return (self.w * x).sum()


def _cfg(stage, data_types=None, gas=GAS, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
           "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}, **extra}  # fmt: skip
    if data_types is not None:
        cfg["data_types"] = data_types
    return cfg


def _one_weight_steps(cfg, lr, steps, xs):
    """Train ``OneWeight`` with torch SGD for ``steps`` optimizer steps on micro-batch inputs ``xs`` (a scalar per
    micro-batch); the fp32 master of ``w``, the gradient norm after each step and the gradient bytes."""
    model = OneWeight()
    engine, *_ = zero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), config=cfg)
    norms = []
    for _ in range(steps):
        for x in xs:
            engine.backward(engine(torch.tensor(x)))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    master = engine.runtime.full_parameters()["w"]
    grad_bytes = engine.runtime.model_state_bytes()["grads"]
    engine.destroy()
    return master, norms, grad_bytes


def _mlp_run(cfg):
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    engine, *_ = zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg)
    rank = torch.distributed.get_rank()
    for i in range(2 * cfg["gradient_accumulation_steps"]):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(10 * i + rank))
        engine.backward(engine(x).square().mean())
        engine.step()
    out = engine.runtime.full_parameters(), engine.runtime.model_state_bytes()["grads"]
    engine.destroy()
    return out


def accum_body(stage):
    xs = [1.0] + [SMALL] * (GAS - 1)
    fp32, norms32, bytes32 = _one_weight_steps(_cfg(stage, {"grad_accum_dtype": "fp32"}), 1.0, 1, xs)
    default, _, _ = _one_weight_steps(_cfg(stage), 1.0, 1, xs)
    bf16, _, _ = _one_weight_steps(_cfg(stage, {"grad_accum_dtype": "bf16"}), 1.0, 1, xs)
    _, frozen, _ = _one_weight_steps(_cfg(stage, {"grad_accum_dtype": "fp32"}), 0.0, 3, xs)
    _, frozen16, _ = _one_weight_steps(_cfg(stage, {"grad_accum_dtype": "bf16"}), 0.0, 3, xs)
    # a real model: "fp32" is the run without the key, bit for bit; "bf16" halves the gradient bytes
    absent, absent_bytes = _mlp_run(_cfg(stage, gas=2))
    explicit, explicit_bytes = _mlp_run(_cfg(stage, {"grad_accum_dtype": "fp32"}, gas=2))
    _, low_bytes = _mlp_run(_cfg(stage, {"grad_accum_dtype": "bf16"}, gas=2))
    return {"fp32": fp32, "default": default, "bf16": bf16, "frozen": frozen, "frozen16": frozen16,
            "norm32": norms32[0], "absent": absent, "explicit": explicit,
            "bytes": (absent_bytes, explicit_bytes, low_bytes)}  # fmt: skip


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_grad_accum_dtype_fp32_exact_bf16_low_precision(stage):
    for r in run_ranks(accum_body, 2, stage, timeout=240, threads=1):
        exact = -(1 + 7 * SMALL) / GAS
        assert exact == -0.126708984375
        assert torch.equal(r["fp32"], torch.full((4,), exact))  # every small micro-batch kept
        if stage >= 2:  # a reduction per micro-batch, added in fp32: the key changes nothing
            assert torch.equal(r["default"], r["fp32"])
        else:  # without the key the fp32 sum is reduced (once) in bf16, as before: rounded, never exact
            assert torch.equal(r["default"], torch.full((4,), -0.126953125))
        assert torch.equal(r["bf16"], torch.full((4,), -0.125))  # bf16 buffers drop them, as DeepSpeed's
        assert r["norm32"] == pytest.approx(2 * -exact, rel=1e-6)  # (per-shard norms in fp32)
        assert r["frozen"] == [r["norm32"]] * 3  # the accumulator is cleared after each step
        assert r["frozen16"] == [pytest.approx(0.25, rel=1e-6)] * 3  # bf16: |0.125| x 2
        for name, value in r["absent"].items():
            if stage >= 2:
                assert torch.equal(r["explicit"][name], value), name
            else:  # the fp32 reduction differs from the bf16 one by bf16 rounding at most
                torch.testing.assert_close(r["explicit"][name], value, rtol=2**-7, atol=1e-3)
        absent_bytes, explicit_bytes, low_bytes = r["bytes"]
        assert absent_bytes == explicit_bytes and low_bytes * 2 == explicit_bytes > 0


def comm_body(stage):
    rank = torch.distributed.get_rank()
    xs = [1.0 if rank == 0 else SMALL]  # the mean, 1/2 + 2**-10, lies between two bf16 values
    fp32_comm, _, _ = _one_weight_steps(_cfg(stage, gas=1, communication_data_type="fp32"), 1.0, 1, xs)
    bf16_comm, _, _ = _one_weight_steps(_cfg(stage, gas=1), 1.0, 1, xs)
    return fp32_comm, bf16_comm


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_with_fp32_communication_reduces_exactly(stage):
    for fp32_comm, bf16_comm in run_ranks(comm_body, 2, stage, timeout=120, threads=1):
        assert torch.equal(fp32_comm, torch.full((4,), -(0.5 + 2.0**-10)))
        assert torch.equal(bf16_comm, torch.full((4,), -0.5))  # the bf16 reduction rounds it


class WithBuffers(torch.nn.Module):
    _keep_in_fp32_modules_strict = ["router"]

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("router_bias", torch.full((4,), 5.001, dtype=torch.bfloat16))
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("steps", torch.zeros(1, dtype=torch.long))

    def forward(self, x):
        return self.fc(x) * self.scale + self.router_bias.float()


def buffers_body(data_types):
    model = WithBuffers()
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3}, "data_types": data_types}  # fmt: skip
    engine, *_ = zero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    out = {k: v.dtype for k, v in engine.module.named_buffers()}
    engine.destroy()
    return out


def test_buffer_dtype_and_keep_in_fp32_modules():
    auto = run_ranks(buffers_body, 2, {"buffer_dtype": "bf16"}, timeout=60, threads=1)[0]
    # "auto": the model's transformers list keeps (and raises) the router buffer in fp32; the rest follow bf16
    assert auto == {"router_bias": torch.float32, "scale": torch.bfloat16, "steps": torch.long}
    listed = run_ranks(buffers_body, 2, {"buffer_dtype": "fp16", "keep_in_fp32_modules": ["sc*"]}, timeout=60)[0]
    assert listed == {"router_bias": torch.float16, "scale": torch.float32, "steps": torch.long}
    plain = run_ranks(buffers_body, 2, {"keep_in_fp32_modules": []}, timeout=60)[0]
    assert plain == {"router_bias": torch.bfloat16, "scale": torch.float32, "steps": torch.long}


@pytest.mark.parametrize(
    ("data_types", "extra", "words"),
    [
        ({"grad_accum_dtype": "fp16"}, {}, "data_types.grad_accum_dtype 'fp16' with 'bf16'"),
        ({"param_dtype": "fp32"}, {}, "data_types.param_dtype 'fp32' conflicts"),
        ({"keep_in_fp32_modules": "all"}, {}, "data_types.keep_in_fp32_modules"),
        ({"grad_accum": "fp32"}, {}, "unknown config key 'data_types.grad_accum'"),
        ({"grad_accum_dtype": "bf16"},
         {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}, "offload_param": {"device": "cpu"}},
         "data_types.grad_accum_dtype 'bf16' is not supported with zero_optimization.offload_optimizer"),
    ],
)  # fmt: skip
def test_bad_data_types_refused_by_name(data_types, extra, words):
    cfg = {"train_batch_size": 2, "bf16": {"enabled": True}, "data_types": data_types,
           "zero_optimization": {"stage": 3, **extra}}  # fmt: skip
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        load_config(cfg, 1)


def test_every_deepspeed_key_accepted():
    cfg = load_config({"train_batch_size": 2, "bf16": {"enabled": True},
                       "data_types": {"grad_accum_dtype": "fp32", "param_dtype": "bf16", "buffer_dtype": "fp32",
                                      "keep_in_fp32_modules": ["router"]}}, 1)  # fmt: skip
    assert cfg.data_types.model_dump() == {"grad_accum_dtype": "fp32", "param_dtype": "bf16", "buffer_dtype": "fp32",
                                           "keep_in_fp32_modules": ["router"]}  # fmt: skip

"""The engine with ``zero_quantized_nontrainable_weights`` at stage 3, bf16, built under ``zero.Init``: a LoRA-style
model's frozen base weights are held as int8 blocks (the bytes of the formula), the default optimizer (every
parameter) trains the adapters only, and the losses follow the unquantized engine's. The numerical bounds of the
scheme are asserted in zero-core's ``test_stage3_frozen_quant``; this checks the DeepSpeed-config plumbing."""

import torch

import zero
from zero_comm.quantize import payload_bytes
from zero_comm.testing import run_ranks

BLOCK = 128


class _LoRA(torch.nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.base = torch.nn.Linear(d_in, d_out)
        self.a = torch.nn.Parameter(torch.randn(2, d_in) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(d_out, 2) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def _cfg(quantized):
    zo = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if quantized:
        zo.update(zero_quantized_nontrainable_weights=True, zeropp_block_size=BLOCK)
    return {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "zero_optimization": zo,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}  # fmt: skip


def _body():
    rank, runs = torch.distributed.get_rank(), {}
    for quantized in (False, True):
        torch.manual_seed(3)
        with zero.zero.Init(config_dict_or_path=_cfg(quantized)):
            model = torch.nn.Sequential(_LoRA(48, 64), torch.nn.Tanh(), _LoRA(64, 48))
        for m in model:
            if isinstance(m, _LoRA):
                m.base.requires_grad_(False)
        engine, *_ = zero.initialize(model=model, config=_cfg(quantized))
        frozen = [g for g in engine.runtime.flat_groups if g.group_index is None]
        store = engine.runtime.params
        held = sum(store.frozen_q.nbytes(g) for g in frozen) if store.frozen_q is not None else None
        formula = sum(payload_bytes(b.chunk, 8, BLOCK) for g in frozen for b in g.buckets)
        losses = []
        for i in range(4):
            g = torch.Generator().manual_seed(10 * i + rank)
            x = torch.randn(4, 48, generator=g).bfloat16()
            loss = (engine(x).float() - 0.5).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        names = sorted({s.name for g in frozen for s in g.slots})
        runs[quantized] = (held, formula, losses, names)
        engine.destroy()
    return runs


def test_engine_holds_frozen_weights_int8_under_zero_init():
    for runs in run_ranks(_body, 2, timeout=120):
        plain, quant = runs[False], runs[True]
        assert plain[0] is None and quant[0] == quant[1] > 0
        # every base weight and bias is frozen-held, the adapters alone train; the optimizer built from the config
        # leaves the frozen ones out with or without the key (DeepSpeed's), which holds them as int8 or not
        assert quant[3] == plain[3] == ["0.base.bias", "0.base.weight", "2.base.bias", "2.base.weight"]
        # same trajectory to well within the int8 error (relative 1/254 per weight) plus bf16 rounding
        for a, b in zip(quant[2], plain[2]):
            assert abs(a - b) <= 0.03 * abs(b), (quant[2], plain[2])
        assert quant[2][-1] < quant[2][0]

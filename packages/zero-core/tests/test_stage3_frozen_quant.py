"""Stage 3 with ``zero_quantized_nontrainable_weights``: a LoRA-style model's frozen base weights held as int8 blocks.

References, 2 gloo ranks, fp32:
- storage: each rank holds, for the frozen units, exactly ``payload_bytes(chunk, 8, block)`` bytes per unit (int8
  values padded to whole blocks plus one fp32 scale per block) and no storage-dtype copy: about 1/4 of fp32's;
- exactness of the scheme: the run equals a single-process PyTorch run of the same model whose base weights are
  replaced by their blockwise int8 round trip, quantized chunk by chunk as the layout cuts them (outputs, and
  adapters after 3 SGD steps, to fp32 reduction-order noise);
- the error it costs: every stored base weight is within its block's ``scale / 2`` of its value; the first forward's
  output differs from the unquantized run's by at most the bound propagated through the layers (below); the adapters
  after 3 steps differ from the unquantized run's by at most 10x the relative weight perturbation of the update;
- checkpoints save the dequantized values and reload them;
- ``zero_init(on_partition=ask_int8_if_frozen)`` (what ``zero.Init`` with the key passes) builds the same.
"""

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_comm.quantize import payload_bytes, torch_dequantize, torch_quantize
from zero_comm.testing import run_ranks
from zero_core import GatheredParameters, ZeroConfig, ZeroRuntime
from zero_core.checkpoint import load_checkpoint, save_checkpoint
from zero_core.frozen_quant import ask_int8_if_frozen
from zero_core.zero_init import zero_init

BLOCK = 256
STEPS, LR = 3, 0.05
DIMS = (64, 96, 64, 8)


class LoRALinear(nn.Module):
    """A frozen base ``Linear`` plus a trainable rank-4 update ``x @ a.T @ b.T``."""

    def __init__(self, d_in, d_out, rank=4):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def _model():
    layers = []
    for i, (d_in, d_out) in enumerate(zip(DIMS[:-1], DIMS[1:])):
        layers.append(LoRALinear(d_in, d_out))
        if i < len(DIMS) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def _batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(16, DIMS[0], generator=g), torch.randn(16, DIMS[-1], generator=g)) for _ in range(STEPS)]


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def _config(quantized):
    extra = {"zero_quantized_nontrainable_weights": True, "zeropp_block_size": BLOCK} if quantized else {}
    return ZeroConfig(stage=3, stage3_param_persistence_threshold=0, **extra)


def _train(rt, model):
    """Outputs of every step's forward (before its update) and the trainable parameters after the steps."""
    outs = []
    for x, y in _batches():
        out = rt.module(x)
        outs.append(out.detach().clone())
        rt.backward((out - y).square().mean())
        rt.step()
    return outs, {n: v for n, v in rt.full_parameters().items() if "base" not in n}


def _round_trip_like_layout(rt, full):
    """``full`` (name -> fp32 value) with every frozen value replaced by its int8 round trip, each rank's chunk of
    each frozen unit quantized on its own as the store does; and name -> each element's block scale / 2 (zero for
    trainable parameters)."""
    out = dict(full)
    half = {n: torch.zeros_like(v) for n, v in full.items()}
    for g in rt.flat_groups:
        if g.group_index is not None:
            continue
        for b in g.buckets:
            flat, err = torch.zeros(b.padded_numel), torch.zeros(b.padded_numel)
            for s in b.slots:
                flat[s.bucket_offset : s.bucket_offset + s.numel] = full[s.name].reshape(-1)
            for r in range(g.partitions):
                lo, hi = b.chunk_range(r)
                qt = torch_quantize(flat[lo:hi], 8, BLOCK)
                flat[lo:hi] = torch_dequantize(qt)
                err[lo:hi] = (qt.scales / 2).repeat_interleave(BLOCK)[: hi - lo]
            for s in b.slots:
                out[s.name] = flat[s.bucket_offset : s.bucket_offset + s.numel].view(s.shape).clone()
                half[s.name] = err[s.bucket_offset : s.bucket_offset + s.numel].view(s.shape).clone()
    return out, half


def _reference(values):
    """Single-process PyTorch: the same model with ``values`` loaded, SGD on the adapters."""
    model = _model()
    model.load_state_dict(values)
    opt = torch.optim.SGD(_trainable(model), lr=LR)
    outs = []
    for x, y in _batches():
        out = model(x)
        outs.append(out.detach().clone())
        (out - y).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return outs, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _output_bound(values, err, x):
    """Elementwise bound on |output(values + E) - output(values)| for any E with |E| <= ``err`` (name -> tensor of
    per-element bounds, zero for trainable parameters): per layer y = W x + c, |dy| <= (|W| + e_W) |dx| + e_W |x| +
    e_c, and tanh is 1-Lipschitz."""
    dx = torch.zeros_like(x)
    for i in range(len(DIMS) - 1):
        pre = f"{2 * i}."
        w, c = values[pre + "base.weight"], values[pre + "base.bias"]
        a, b = values[pre + "a"], values[pre + "b"]
        ew, ec = err[pre + "base.weight"], err[pre + "base.bias"]
        dx = dx @ (w.abs() + ew + (b @ a).abs()).t() + x.abs() @ ew.t() + ec
        x = x @ w.t() + c + x @ a.t() @ b.t()
        if i < len(DIMS) - 2:
            x = torch.tanh(x)
    return dx


def _body(root):
    torch.manual_seed(0)
    init = {n: v.clone() for n, v in _model().state_dict().items()}
    rank = dist.get_rank()
    runs = {}
    for quantized in (False, True):
        model = _model()
        model.load_state_dict(init)
        rt = ZeroRuntime(model, torch.optim.SGD(_trainable(model), lr=LR), _config(quantized))
        runs[f"params bytes {quantized}"] = rt.model_state_bytes()["params"]  # every unit released here
        if quantized:
            store = rt.params
            frozen = [g for g in rt.flat_groups if g.group_index is None]
            held = sum(store.frozen_q.packed[b].untyped_storage().nbytes() for g in frozen for b in g.buckets)
            formula = sum(payload_bytes(b.chunk, 8, BLOCK) for g in frozen for b in g.buckets)
            fp32 = sum(g.shard_numel * 4 for g in frozen)
            no_copy = all(store.shard_view(g) is None for g in frozen)
            stored = rt.full_parameters()  # frozen entries: the dequantized stored values
            runs["memory"] = (held, formula, fp32, no_copy, sum(store.frozen_q.nbytes(g) for g in frozen))
            runs["stored"] = stored
            runs["layout"] = _round_trip_like_layout(rt, init)
        runs[quantized] = _train(rt, model)
        if quantized:
            d = f"{root}/ckpt"
            save_checkpoint(rt, d, "t")
            before = rt.full_parameters()
            again = _model()
            fresh = ZeroRuntime(again, torch.optim.SGD(_trainable(again), lr=LR), _config(True))
            load_checkpoint(fresh, d, "t")
            runs["reloaded"] = (before, fresh.full_parameters(), fresh.params.frozen_q is not None)
            fresh.close()
        rt.close()
    # the optimizer given every parameter (zero.initialize's default): the frozen ones still held as int8, as
    # DeepSpeed's stage 3 leaves requires_grad=False parameters out of its groups
    model = _model()
    model.load_state_dict(init)
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=LR), _config(True))
    runs["all in optimizer"] = _train(rt, model)
    rt.close()
    # zero_init(on_partition=ask_int8_if_frozen), as zero.Init(zero_quantized_nontrainable_weights=True): the same run
    for key in (True, False):
        torch.manual_seed(0)  # the same values as ``init``
        with zero_init(on_partition=ask_int8_if_frozen):
            built = _model()
        cfg = _config(True) if key else ZeroConfig(stage=3, stage3_param_persistence_threshold=0)
        rt = ZeroRuntime(built, torch.optim.SGD(_trainable(built), lr=LR), cfg)
        held = rt.params.frozen_q is not None
        runs[f"zero_init {key}"] = (held, _train(rt, built) if key else None)
        rt.close()
    return rank, runs


def test_lora_model_trains_with_int8_frozen_weights():
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_body, 2, root, timeout=150)
    torch.manual_seed(0)
    init = {n: v.clone() for n, v in _model().state_dict().items()}
    for rank, runs in results:
        what = f"rank {rank}"
        # storage: exactly int8 data padded to whole blocks + one fp32 scale per block per unit chunk, no fp32 copy
        held, formula, fp32, no_copy, reported = runs["memory"]
        assert held == formula == reported and no_copy, (what, held, formula, reported)
        # the memory report counts the blocks instead of the fp32 shard
        assert runs["params bytes False"] - runs["params bytes True"] == fp32 - held, what
        # about 1/4: 1 byte per element + 4 / BLOCK for the scales, plus each chunk padded to whole blocks (the
        # 8-wide last layer's 260-element chunk fills two 256-element blocks)
        assert 0.25 <= held / fp32 <= 0.29, (what, held / fp32)
        # the stored values are the layout's chunk-by-chunk int8 round trip, and within scale / 2 of the values
        stored, (layout, half) = runs["stored"], runs["layout"]
        for n in init:
            assert torch.equal(stored[n], layout[n]), (what, n)
            # every element within its block's scale / 2 (scale = block absmax / 127), trainable ones exact
            assert ((stored[n] - init[n]).abs() <= half[n] * (1 + 1e-6)).all(), (what, n)
            if "base" in n:
                assert 0 < (stored[n] - init[n]).abs().max(), (what, n)  # quantization really happened
        # exactness: the run equals single-process PyTorch on the round-tripped base weights (reduction order only)
        ref_outs, ref_params = _reference(layout)
        outs, params = runs[True]
        for a, b in zip(outs, ref_outs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for n, v in ref_params.items():
            torch.testing.assert_close(params[n], v, rtol=1e-5, atol=1e-6, msg=f"{what} {n}")
        # the cost: the first forward's output within the propagated scale / 2 bound of the unquantized run's
        plain_outs, plain_params = runs[False]
        x0 = _batches()[0][0]
        bound = _output_bound(init, half, x0)
        diff = (outs[0] - plain_outs[0]).abs()
        assert (diff <= bound * (1 + 1e-4) + 1e-6).all() and diff.max() > 0, (what, diff.max(), bound.max())
        # adapters after 3 steps: their change from the unquantized run's, relative to the update itself, at most
        # 10x the relative perturbation of the frozen weights (the update is first order in the weights)
        eps = max(((stored[n] - init[n]).norm() / init[n].norm()).item() for n in init if "base" in n)
        for n, v in plain_params.items():
            moved = (v - init[n]).norm()
            assert moved > 0, (what, n)
            assert (params[n] - v).norm() <= 10 * eps * moved, (what, n, ((params[n] - v).norm() / moved).item(), eps)
        # checkpoints: the dequantized values are saved; a reload holds them again (quantized back to the same
        # int8 codes; the scales may move by an ulp)
        before, after, quantized_again = runs["reloaded"]
        assert quantized_again
        for n in before:
            torch.testing.assert_close(after[n], before[n], rtol=1e-6, atol=1e-7, msg=f"{what} {n}")
        every = runs["all in optimizer"]
        assert all(torch.equal(a, b) for a, b in zip(every[0], outs)), what
        assert all(torch.equal(every[1][n], v) for n, v in params.items()), what
        # zero_init(on_partition=ask_int8_if_frozen) builds the same store, with or without the config key
        held_key, run_key = runs["zero_init True"]
        held_nokey, _ = runs["zero_init False"]
        assert held_key and held_nokey
        for a, b in zip(run_key[0], outs):
            assert torch.equal(a, b), what
        for n, v in params.items():
            assert torch.equal(run_key[1][n], v), (what, n)


def _edit_and_qwz_body():
    torch.manual_seed(0)
    init = {n: v.clone() for n, v in _model().state_dict().items()}
    out = {}
    for qwz in (False, True):
        model = _model()
        model.load_state_dict(init)
        cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=0, zero_quantized_nontrainable_weights=True,
                         zero_quantized_weights=qwz, zeropp_block_size=BLOCK)  # fmt: skip
        rt = ZeroRuntime(model, torch.optim.SGD(_trainable(model), lr=LR), cfg)
        out[qwz] = _train(rt, model)
        if not qwz:  # an edit of a frozen weight through GatheredParameters is stored (quantized again)
            w = model[0].base.weight
            with GatheredParameters(w, modifier_rank=0):
                edited = (w * 2).detach().clone()  # the gathered (dequantized) values, doubled
                if dist.get_rank() == 0:
                    w.copy_(edited)
            out["edited"] = (edited, rt.full_parameters()["0.base.weight"])
        rt.close()
    return out


def test_gathered_edit_and_qwz_with_int8_frozen_weights():
    for out in run_ranks(_edit_and_qwz_body, 2, timeout=90):
        # doubling a value on the int8 grid doubles its scale: the same codes, exactly representable again
        edited, stored = out["edited"]
        torch.testing.assert_close(stored, edited, rtol=1e-6, atol=0)
        # qwZ on top: the frozen units gather their int8 blocks as without it; the trainable units' gathers are
        # quantized too, so the adapters move by qwZ's own error (relative 1/254 of a block's absmax per element)
        (outs, params), (q_outs, q_params) = out[False], out[True]
        assert not torch.equal(outs[0], q_outs[0])  # qwZ acts on the adapters' gathers
        torch.testing.assert_close(q_outs[0], outs[0], rtol=0.05, atol=1e-3)
        for n, v in params.items():
            torch.testing.assert_close(q_params[n], v, rtol=0.05, atol=1e-3, msg=n)


def test_key_is_ignored_below_stage3_and_refused_with_stores_it_cannot_reach():
    # DeepSpeed reads the key only at stage 3; below, it is accepted and does nothing: said here with a warning
    for stage in (0, 1, 2):
        with pytest.warns(UserWarning, match=f"zero_quantized_nontrainable_weights has no effect at stage {stage}"):
            ZeroConfig(stage=stage, zero_quantized_nontrainable_weights=True)
    with pytest.raises(ValueError, match="zeropp_block_size has an effect only with"):  # stage 2: no int8 store
        ZeroConfig(stage=2, zero_quantized_nontrainable_weights=True, zeropp_block_size=BLOCK)
    cfg = ZeroConfig(stage=3, zero_quantized_nontrainable_weights=True, zeropp_block_size=BLOCK)
    assert cfg.zeropp_block_size == BLOCK
    with pytest.raises(ValueError, match="zero_quantized_nontrainable_weights with offload_param.device='cpu'"):
        ZeroConfig(stage=3, zero_quantized_nontrainable_weights=True, offload_param={"device": "cpu"})
    with pytest.raises(ValueError, match="zero_quantized_nontrainable_weights with zero_hpz_partition_size > 1"):
        ZeroConfig(stage=3, zero_quantized_nontrainable_weights=True, zero_hpz_partition_size=2)

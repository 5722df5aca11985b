"""``compile.passes: ["autosp"]``: Ulysses sequence parallelism inserted in the compiled graph equals the eager
Ulysses adapter and one process on the whole sequence.

One 2-rank launch (sp=2, dp=1, gloo, inner compiler "aot_eager"), transformers' tiny Llama (4 query heads, 2 KV
heads, grouped-query attention in sdpa), ZeRO stage 1, AdamW, 2 steps, each rank feeding its half of every sequence:
per step the loss (``sequence_parallel_loss``) and every parameter's full gradient (``safe_get_full_grad``) of the
compiled run equal those of the eager adapter run and of the single-process run on the whole sequences, and so do
the final parameters (1e-5 relative). The same launch checks a model with 1 KV head (fewer than sp: the pass
repeats it) by its gradients, runs ``torch.library.opcheck`` on both exchange operations at odd sequence shards and
head counts, checks their values against an all-gathered reference, and the refusals that need ranks.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from zero_comm.testing import run_ranks

SP, BATCH, SEQ, STEPS, LR = 2, 2, 12, 2, 1e-2
_CHEAP_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _tiny_llama(kv_heads: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same weights on every rank
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config)


def _batches():
    """``(input_ids, labels)`` per step, ``[BATCH, SEQ]`` int64; the first SEQ // 3 positions are not counted."""
    from zero_parallel import IGNORE_INDEX

    out = []
    for step in range(STEPS):
        ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        labels = ids.clone()
        labels[:, : SEQ // 3] = IGNORE_INDEX
        out.append((ids, labels))
    return out


def _shard(ids, labels, rank):
    """This rank's inputs: its half of the positions, and the labels shifted over the whole sequence."""
    from zero_parallel import IGNORE_INDEX

    cut = slice(rank * SEQ // SP, (rank + 1) * SEQ // SP)
    shift = torch.cat([labels[:, 1:], torch.full((BATCH, 1), IGNORE_INDEX)], dim=1)[:, cut].contiguous()
    return ids[:, cut], torch.arange(SEQ).expand(BATCH, -1)[:, cut], shift


def _reference(model):
    """One process, whole sequences, AdamW clipped at 1.0 (zero's default): losses, gradients, parameters."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], []
    for ids, labels in _batches():
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(model, mpu, compiled: bool):
    """2 steps of the engine at stage 1 over ``mpu``: losses, full gradients per step, final parameters."""
    import zero
    from zero.engine.param_access import safe_get_full_grad
    from zero_parallel import sequence_parallel_loss

    cfg = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH, "sequence_parallel_size": SP,
           "zero_optimization": {"stage": 1}}  # fmt: skip
    if compiled:
        cfg["compile"] = {"deepcompile": True, "passes": ["autosp"], "backend": "aot_eager"}
    engine, *_ = zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), config=cfg,
                                 mpu=mpu)  # fmt: skip
    rank, group = mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_group()
    losses, grads = [], []
    for ids, labels in _batches():
        ids, positions, shift = _shard(ids, labels, rank)
        out = engine(input_ids=ids, position_ids=positions, labels=shift, shift_labels=shift)
        loss = sequence_parallel_loss(out.loss, shift, group)
        engine.backward(loss)
        losses.append(loss.item())
        grads.append({n: safe_get_full_grad(p).clone() for n, p in model.named_parameters()})
        engine.step()
    # what Engine.forward calls: the model compiled by torch.compile (the autosp backend), or the model itself
    compiles = isinstance(engine._forward, torch._dynamo.eval_frame.OptimizedModule)
    engine.destroy()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}, compiles


def _worst(got: dict, want: dict) -> float:
    """The largest relative error ``||got - want|| / ||want||`` over the tensors of ``want``."""
    return max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items())


def _gqa_repeat_gradients(rank: int) -> float:
    """1 KV head at sp=2, no engine: the pass repeats it; the mean of the ranks' gradients against the whole
    sequence's."""
    from zero_compile.sp_backend import SequenceParallelBackend
    from zero_parallel import sequence_parallel_loss

    model = _tiny_llama(kv_heads=1)
    want = copy.deepcopy(model)
    ids, labels = _batches()[0]
    want(input_ids=ids, labels=labels).loss.backward()
    backend = SequenceParallelBackend(dist.group.WORLD, inner="aot_eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids, positions, shift = _shard(ids, labels, rank)
    out = compiled(input_ids=ids, position_ids=positions, labels=shift, shift_labels=shift)
    sequence_parallel_loss(out.loss, shift, dist.group.WORLD).backward()
    got = {}
    for n, p in model.named_parameters():
        got[n] = p.grad.clone()
        dist.all_reduce(got[n])
        got[n] /= SP
    assert backend.notes[0]["autosp"] == {"attention": 2, "kv_repeats": 4}, backend.notes
    return _worst(got, {n: p.grad for n, p in want.named_parameters()})


def _ops_checked(rank: int) -> dict:
    """opcheck on both exchanges (odd shard lengths and head counts, GQA-sized key/value), their values against
    an all-gathered reference, and the shape errors."""
    from zero_compile.sp_ops import HEADS_TO_SEQUENCE, SEQUENCE_TO_HEADS, register_sp_group

    gid = register_sp_group(dist.group.WORLD)
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own values
    shapes = {SEQUENCE_TO_HEADS: [(2, 6, 3, 4), (2, 2, 3, 4), (1, 2, 5, 8)],
              HEADS_TO_SEQUENCE: [(2, 3, 6, 4), (1, 1, 10, 8)]}  # fmt: skip
    for op, sizes in shapes.items():
        for i, size in enumerate(sizes):
            x = torch.randn(size, generator=gen, dtype=torch.float64, requires_grad=True)
            # the compiled (aot_dispatch_dynamic) check once per op: it costs a compilation each time
            utils = (*_CHEAP_CHECKS, "test_aot_dispatch_dynamic") if i == 0 else _CHEAP_CHECKS
            torch.library.opcheck(op, (x, gid, SP), test_utils=utils)
    # values: sequence_to_heads(x) is this rank's heads of the whole sequence; heads_to_sequence undoes it
    x = torch.randn(2, 6, 3, 4, generator=gen)
    full = [torch.empty_like(x) for _ in range(SP)]
    dist.all_gather(full, x)
    whole = torch.cat(full, dim=2)  # [b, h, s, d]
    y = SEQUENCE_TO_HEADS(x, gid, SP)
    errors = []
    for op, bad in ((SEQUENCE_TO_HEADS, torch.zeros(1, 3, 2, 4)), (HEADS_TO_SEQUENCE, torch.zeros(1, 2, 3, 4)),
                    (SEQUENCE_TO_HEADS, torch.zeros(3, 2, 4))):  # fmt: skip
        try:
            op(bad, gid, SP)
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    return {"values": torch.equal(y, whole[:, rank * 3 : (rank + 1) * 3]),
            "round_trip": torch.equal(HEADS_TO_SEQUENCE(y, gid, SP), x), "errors": errors}  # fmt: skip


def _refused_with_the_eager_adapter() -> str:
    import zero
    from zero_parallel import UlyssesSPAttentionHF, unregister_from_transformers

    model = _tiny_llama()
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": 1},
           "compile": {"deepcompile": True, "passes": ["autosp"], "backend": "aot_eager"}}  # fmt: skip
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", SP, BATCH)
    try:
        zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), config=cfg, mpu=mpu)
        return "no error"
    except zero.ConfigError as e:
        return str(e)
    finally:
        unregister_from_transformers("sdpa")


def _autosp_body() -> dict:
    from zero_parallel import SequenceParallelMPU, UlyssesSPAttentionHF, unregister_from_transformers

    torch._dynamo.reset()  # warm workers are reused across tests
    rank = dist.get_rank()
    base = _tiny_llama()
    ref_losses, ref_grads, ref_params = _reference(base)
    mpu = UlyssesSPAttentionHF.register_with_transformers(base, "sdpa", SP, BATCH)
    try:
        eager = _train(copy.deepcopy(base), mpu, compiled=False)
    finally:
        unregister_from_transformers("sdpa")
    auto = _train(copy.deepcopy(base), SequenceParallelMPU.build(SP), compiled=True)
    out = {
        "ref_losses": ref_losses,
        "eager_losses": eager[0],
        "auto_losses": auto[0],
        "compiled": auto[3],
        "eager_compiled": eager[3],
    }
    for name, run in (("eager", eager), ("auto", auto)):
        out[f"{name}_grads_vs_ref"] = max(_worst(g, w) for g, w in zip(run[1], ref_grads))
        out[f"{name}_params_vs_ref"] = _worst(run[2], ref_params)
    out["auto_grads_vs_eager"] = max(_worst(g, w) for g, w in zip(auto[1], eager[1]))
    out["moved"] = min((p - ref_params[n]).abs().max().item() for n, p in _tiny_llama().named_parameters())
    out["gqa_repeat_grads_vs_ref"] = _gqa_repeat_gradients(rank)
    out["ops"] = _ops_checked(rank)
    out["adapter_refusal"] = _refused_with_the_eager_adapter()
    return out


def test_autosp_equals_eager_ulysses_and_the_whole_sequence():
    for out in run_ranks(_autosp_body, SP, timeout=300):
        assert out["compiled"] and not out["eager_compiled"]  # autosp's engine runs the compiled module
        torch.testing.assert_close(out["auto_losses"], out["ref_losses"], rtol=1e-5, atol=0)
        torch.testing.assert_close(out["auto_losses"], out["eager_losses"], rtol=1e-5, atol=0)
        assert out["auto_grads_vs_ref"] <= 1e-5 and out["auto_grads_vs_eager"] <= 1e-5, out
        assert out["eager_grads_vs_ref"] <= 1e-5, out  # the eager run is itself exact
        assert out["auto_params_vs_ref"] <= 1e-5 and out["moved"] > 1e-3, out
        assert out["gqa_repeat_grads_vs_ref"] <= 1e-5, out
        ops = out["ops"]
        assert ops["values"] and ops["round_trip"], ops
        assert "x has 3 heads (shape (1, 3, 2, 4)), not divisible by the sequence-parallel size 2" in ops["errors"][0]
        assert "x has 3 sequence positions (shape (1, 2, 3, 4))" in ops["errors"][1]
        assert "x must be 4-D [batch, heads, seq, head_dim], got (3, 2, 4)" in ops["errors"][2]
        assert "eager Ulysses adapter registered for 'sdpa'" in out["adapter_refusal"], out["adapter_refusal"]

"""transformers' tiny Llama with Ulysses registered at sp=2 (2 gloo ranks): each rank's logits for its sequence shard
equal the matching slice of the single-process model's logits on the whole sequence (1e-5), at two lengths."""

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from zero_comm.testing import run_ranks
from zero_parallel import (
    IGNORE_INDEX,
    SequenceParallelMPU,
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
    sequence_parallel_loss,
    unregister_from_transformers,
)

SP, BATCH = 2, 2


def _tiny_llama(kv_heads: int) -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same weights on every rank
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config)


def _logits_match(kv_heads: int, seqs: tuple) -> list[float]:
    model = _tiny_llama(kv_heads)
    data = [torch.randint(0, 64, (BATCH, s), generator=torch.Generator().manual_seed(s)) for s in seqs]
    with torch.no_grad():
        references = [model(input_ids=ids).logits for ids in data]  # before registering: plain sdpa
    try:
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", SP, BATCH, seq_length_is_variable=True)
        assert isinstance(mpu, SequenceParallelMPU) and mpu.get_sequence_parallel_world_size() == SP
        rank, worst = mpu.get_sequence_parallel_rank(), []
        for ids, reference in zip(data, references):
            s = ids.shape[1]
            shard = slice(rank * s // SP, (rank + 1) * s // SP)
            positions = torch.arange(s).expand(BATCH, -1)
            with torch.no_grad():
                logits = model(input_ids=ids[:, shard], position_ids=positions[:, shard]).logits
            torch.testing.assert_close(logits, reference[:, shard], atol=1e-5, rtol=0)
            worst.append((logits - reference[:, shard]).abs().max().item())
        return worst
    finally:
        unregister_from_transformers("sdpa")


@pytest.mark.smoke
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "sp-exceeds-kv-heads"])
def test_llama_shard_logits_equal_full_sequence_logits(kv_heads):
    for worst in run_ranks(_logits_match, SP, kv_heads, (6, 30), timeout=90):
        assert len(worst) == 2 and max(worst) <= 1e-5


def _eval_runs_locally() -> bool:
    model = _tiny_llama(2)
    ids = torch.randint(0, 64, (BATCH, 10), generator=torch.Generator().manual_seed(1))
    try:
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", SP, BATCH, 10, False, True)
        shard = slice(5 * mpu.get_sequence_parallel_rank(), 5 * mpu.get_sequence_parallel_rank() + 5)
        positions = torch.arange(10).expand(BATCH, -1)[:, shard]
        with torch.no_grad():
            model.eval()
            in_eval = model(input_ids=ids[:, shard], position_ids=positions).logits
            model.train()
            in_train = model(input_ids=ids[:, shard], position_ids=positions).logits
    finally:
        unregister_from_transformers("sdpa")
    with torch.no_grad():  # the shard alone, without sequence parallelism
        alone = model(input_ids=ids[:, shard], position_ids=positions).logits
    return (in_eval - alone).abs().max().item(), (in_train - alone).abs().max().item()


def test_disable_in_eval_runs_the_core_attention_on_the_shard():
    (eval0, train0), (eval1, train1) = run_ranks(_eval_runs_locally, SP, timeout=90)
    assert eval0 == eval1 == 0.0  # in eval: the shard alone, through the same core function
    assert train0 <= 1e-5  # causal: rank 0's shard attends to itself only, sequence-parallel or not
    assert train1 > 1e-3  # in training rank 1's shard attends to rank 0's positions too


def test_eager_and_mismatched_implementations_are_refused():
    with pytest.raises(ValueError, match="core_attn_implementation='eager' is not supported by Ulysses"):
        UlyssesSPAttentionHF.register_with_transformers(_tiny_llama(2), "eager", SP, BATCH)
    with pytest.raises(ValueError, match="'flash_attention_2' is not one of"):
        UlyssesSPAttentionHF.register_with_transformers(_tiny_llama(2), "flash_attention_2", SP, BATCH)
    with pytest.raises(ValueError, match="seq_length is required when seq_length_is_variable=False"):
        UlyssesSPAttentionHF.register_with_transformers(_tiny_llama(2), "sdpa", SP, BATCH, None, False)
    with pytest.raises(ValueError, match="differs from the model's attn_implementation 'sdpa'"):
        UlyssesSPAttentionHF.register_with_transformers(_tiny_llama(2), "flex_attention", SP, BATCH)
    assert UlyssesSPAttentionHF.register_with_transformers(_tiny_llama(2), "sdpa", 1, BATCH) is None


def _batch(seq: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (BATCH, seq), generator=g)
    labels = ids.clone()
    labels[:, : seq // 3] = IGNORE_INDEX  # a prompt that does not count in the loss
    return {"input_ids": ids, "position_ids": torch.arange(seq).expand(BATCH, -1), "labels": labels}


def _loss_and_grads_match() -> list[tuple[float, float]]:
    model = _tiny_llama(2)
    batches = [_batch(6, 0), _batch(30, 1)]  # rank r's own loader yields batches[r]
    references = []
    for b in batches:  # single process, whole sequences, before registering
        model.zero_grad()
        loss = model(input_ids=b["input_ids"], labels=b["labels"]).loss
        loss.backward()
        references.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    try:
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", SP, BATCH, seq_length_is_variable=True)
        rank, group = mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_group()
        loader = UlyssesSPDataLoaderAdapter([batches[rank]], rank, group, SP, "cpu")
        assert len(loader) == SP
        worst = []
        for micro_batch, (ref_loss, ref_grads) in zip(loader, references, strict=True):
            assert "labels" not in micro_batch and micro_batch["shift_labels"].shape == micro_batch["input_ids"].shape
            model.zero_grad()
            shard_loss = model(**micro_batch, labels=micro_batch["shift_labels"]).loss  # as the HF Trainer calls it
            loss = sequence_parallel_loss(shard_loss, micro_batch["shift_labels"], group)
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]
            for g in grads:  # the mean over the sequence-parallel group, as ZeRO's average over sp x dp makes it
                dist.all_reduce(g, group=group)
                g /= SP
            torch.testing.assert_close(loss.detach(), ref_loss, atol=1e-6, rtol=1e-6)
            for got, want in zip(grads, ref_grads, strict=True):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
            worst.append(
                ((loss - ref_loss).abs().item(), max((a - b).abs().max().item() for a, b in zip(grads, ref_grads)))
            )
        # the pass above ended with StopIteration (zip's strict check); the next pass starts again from the top
        assert torch.equal(next(loader)["input_ids"], batches[0]["input_ids"][:, rank * 3 : rank * 3 + 3])
        return worst
    finally:
        unregister_from_transformers("sdpa")


def test_sharded_batches_give_the_full_sequence_loss_and_gradients():
    for worst in run_ranks(_loss_and_grads_match, SP, timeout=120):
        assert len(worst) == 2 and all(loss_err <= 1e-6 and grad_err <= 1e-5 for loss_err, grad_err in worst)


def _loader_errors() -> list[str]:
    group, rank = dist.group.WORLD, dist.get_rank()
    good = _batch(6, 0)
    cases = [
        {k: v for k, v in good.items() if k != "position_ids"},
        {**good, "labels": good["labels"][:, :4]},
        _batch(5, 0),
    ]
    msgs = []
    for batch in cases:
        try:
            next(UlyssesSPDataLoaderAdapter([batch], rank, group, SP, "cpu"))
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_loader_names_what_a_batch_lacks():
    for msgs in run_ranks(_loader_errors, SP, timeout=60):
        assert msgs[0].startswith("the batch has no 'position_ids'")
        assert msgs[1].startswith("labels has shape (2, 4); expected [batch, seq] = (2, 6) like input_ids")
        assert msgs[2].startswith("sequence length 5 is not divisible by sp_world_size=2")

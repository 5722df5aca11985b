"""transformers' tiny Llama with Ulysses registered at sp=2 (2 gloo ranks): each rank's logits for its sequence shard
equal the matching slice of the single-process model's logits on the whole sequence (1e-5), at two lengths."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from zero_comm.testing import run_ranks
from zero_parallel import SequenceParallelMPU, UlyssesSPAttentionHF, unregister_from_transformers

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

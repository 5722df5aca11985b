"""Sequence-tiled compute equals the untiled computation (fp32, 1e-6): ``TiledMLP``, ``TiledFusedLogitsLoss`` and
``SequenceTiledCompute``, forward and the gradients of the input and of every parameter, at tile counts that do not
divide the sequence (and one larger than it); each parameter's gradient is accumulated once per call; the forward
keeps only its input and the backward's saved intermediates are one tile long."""

import pytest
import torch
import torch.nn.functional as F

from zero_parallel import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute, tile_bounds

TOL = dict(atol=1e-6, rtol=1e-6)


class MLP(torch.nn.Module):
    """Llama's gated MLP (no bias), hidden 8 -> 12 -> 8."""

    def __init__(self, hidden=8, inner=12):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inner, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inner, bias=False)
        self.down_proj = torch.nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def mlp_forward(module, x):
    return module.forward(x)


def _count_accumulations(params):
    counts = {id(p): 0 for p in params}
    for p in params:
        p.register_post_accumulate_grad_hook(lambda q: counts.__setitem__(id(q), counts[id(q)] + 1))
    return counts


def _grads(module):
    return [p.grad.clone() for p in module.parameters()]


def test_tile_bounds_split_like_tensor_split():
    assert tile_bounds(10, 3) == [(0, 4), (4, 3), (7, 3)]
    assert tile_bounds(3, 5) == [(0, 1), (1, 1), (2, 1)]
    assert tile_bounds(0, 2) == [(0, 0)]
    with pytest.raises(ValueError, match="shards must be a positive integer"):
        tile_bounds(4, 0)


@pytest.mark.parametrize("shards", [3, 4, 11])
def test_tiled_mlp_equals_untiled(shards):
    torch.manual_seed(0)
    ref, mod = MLP(), MLP()
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(2, 10, 8)
    w = torch.randn(2, 10, 8)
    x_ref, x_t = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = ref(x_ref)
    (out_ref * w).sum().backward()

    counts = _count_accumulations(list(mod.parameters()))
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = TiledMLP.apply(mlp_forward, mod, x_t, shards, list(mod.parameters()))
    assert saved == [(2, 10, 8)]  # the forward keeps its input only: no intermediate of any tile
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        (out * w).sum().backward()
    longest = max(n for _, n in tile_bounds(10, shards))
    recomputed = [torch.Size(s).numel() for s in saved if s != (2, 10, 8)]  # less what ``out * w`` saves
    # one tile's activations at a time (2 x tile x 12 elements, or a 96-element weight), never 2 x 10 x 12
    assert recomputed and max(recomputed) <= max(96, 2 * longest * 12) < 2 * 10 * 12, saved

    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(x_t.grad, x_ref.grad, **TOL)
    for g, g_ref in zip(_grads(mod), _grads(ref)):
        torch.testing.assert_close(g, g_ref, **TOL)
    assert set(counts.values()) == {1}  # one accumulation per parameter per call, not one per tile


def test_tiled_mlp_without_compute_params_and_frozen_input():
    torch.manual_seed(1)
    ref, mod = MLP(), MLP()
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(7, 8)  # [seq, hidden] (mixture-of-experts tokens)
    ref(x).pow(2).sum().backward()
    TiledMLP.apply(mlp_forward, mod, x, 3, None).pow(2).sum().backward()
    for g, g_ref in zip(_grads(mod), _grads(ref)):
        torch.testing.assert_close(g, g_ref, **TOL)
    with pytest.raises(ValueError, match=r"TiledMLP: x must be \[..., seq, hidden\]"):
        TiledMLP.apply(mlp_forward, mod, torch.randn(8), 2, None)
    with pytest.raises(TypeError, match=r"compute_params\[0\] must be a tensor"):
        TiledMLP.apply(mlp_forward, mod, x, 2, ["weight"])


def _ce(head, x, y):
    logits = head(x).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), ignore_index=-100, reduction="sum")


def _ce_masked(head, x, y, mask):
    return (F.cross_entropy(head(x), y, reduction="none") * mask).sum()


@pytest.mark.parametrize("shards", [3, 5])
def test_tiled_fused_logits_loss_equals_untiled(shards):
    torch.manual_seed(2)
    ref, head = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
    head.load_state_dict(ref.state_dict())
    x = torch.randn(2, 7, 8)
    y = torch.randint(0, 16, (2, 7))
    y[0, 2] = -100
    x_ref, x_t = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss_ref = _ce(ref, x_ref, y)
    (loss_ref * 2.5).backward()  # an incoming gradient other than 1 (a loss scale) scales every gradient
    counts = _count_accumulations(list(head.parameters()))
    loss = TiledFusedLogitsLoss.apply(_ce, head, x_t, y, None, shards, list(head.parameters()), "sum")
    (loss * 2.5).backward()
    torch.testing.assert_close(loss, loss_ref, **TOL)
    torch.testing.assert_close(x_t.grad, x_ref.grad, **TOL)
    for g, g_ref in zip(_grads(head), _grads(ref)):
        torch.testing.assert_close(g, g_ref, **TOL)
    assert set(counts.values()) == {1}

    # "mean": the mean of the tiles' losses (each tile's sum here), with a mask passed to fn
    head.zero_grad()
    mask = torch.rand(2, 7).round()
    x_m = x.clone().requires_grad_()
    loss = TiledFusedLogitsLoss.apply(_ce_masked, head, x_m, y.clamp(min=0), mask, shards, [head.weight], "mean")
    loss.backward()
    xf, yf, mf = x.view(14, 8).requires_grad_(), y.clamp(min=0).view(14), mask.view(14)
    ref.zero_grad()
    tiles = [(s, n) for s, n in tile_bounds(14, shards)]
    expected = torch.stack([_ce_masked(ref, xf[s : s + n], yf[s : s + n], mf[s : s + n]) for s, n in tiles]).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected, **TOL)
    torch.testing.assert_close(x_m.grad.view(14, 8), xf.grad, **TOL)
    torch.testing.assert_close(head.weight.grad, ref.weight.grad, **TOL)

    with torch.no_grad():  # evaluation: no gradients taken
        torch.testing.assert_close(TiledFusedLogitsLoss.apply(_ce, head, x, y, None, shards, [], "sum"), loss_ref)
    with pytest.raises(ValueError, match="output_reduction must be 'mean' or 'sum'"):
        TiledFusedLogitsLoss.apply(_ce, head, x, y, None, shards, [], None)
    with pytest.raises(ValueError, match=r"mask must be \(2, 7\)"):
        TiledFusedLogitsLoss.apply(_ce, head, x, y, torch.ones(14), shards, [], "sum")


def test_sequence_tiled_compute_equals_untiled():
    torch.manual_seed(3)
    ref, mod = MLP(), MLP()
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(2, 10, 8)
    scale = torch.randn(2, 10, 1)  # sharded, no gradient
    bias = torch.randn(8)  # passed whole

    def fn(hidden_states, scale, bias, module):
        return module(hidden_states) * scale + bias

    w = torch.randn(2, 10, 8)
    x_ref = x.clone().requires_grad_()
    (fn(x_ref, scale, bias, ref) * w).sum().backward()
    counts = _count_accumulations(list(mod.parameters()))
    x_t = x.clone().requires_grad_()
    out = sequence_tiled_compute(fn, 10, 3, {"hidden_states": x_t, "scale": scale}, {"bias": bias, "module": mod},
                                 "hidden_states", list(mod.parameters()), 1, None)  # fmt: skip
    (out * w).sum().backward()
    torch.testing.assert_close(out, fn(x, scale, bias, ref), **TOL)
    torch.testing.assert_close(x_t.grad, x_ref.grad, **TOL)
    for g, g_ref in zip(_grads(mod), _grads(ref)):
        torch.testing.assert_close(g, g_ref, **TOL)
    assert set(counts.values()) == {1}

    # one loss per tile (output_unshard_dimension=0), "mean" over tiles, through apply's positional form
    def tile_loss(hidden_states):
        return ref(hidden_states).pow(2).mean()

    ref.zero_grad()
    x_t = x.clone().requires_grad_()
    loss = SequenceTiledCompute.apply(tile_loss, 10, 4, ["hidden_states"], [], "hidden_states", None, 0, "mean", x_t)
    loss.backward()
    grads = _grads(ref)
    ref.zero_grad()
    x_ref = x.clone().requires_grad_()
    torch.stack([tile_loss(x_ref[:, s : s + n]) for s, n in tile_bounds(10, 4)]).mean().backward()
    torch.testing.assert_close(x_t.grad, x_ref.grad, **TOL)
    for g, g_ref in zip(grads, _grads(ref)):
        torch.testing.assert_close(g, g_ref, **TOL)

    with pytest.raises(ValueError, match=r"'hidden_states' must be a tensor \[batch, 9, ...\]"):
        SequenceTiledCompute.apply(tile_loss, 9, 2, ["hidden_states"], [], "hidden_states", None, 0, "mean", x)
    with pytest.raises(ValueError, match="grad_requiring_tensor_key 'x' must be one of keys_to_shard"):
        SequenceTiledCompute.apply(tile_loss, 10, 2, ["hidden_states"], [], "x", None, 0, "mean", x)

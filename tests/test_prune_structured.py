"""Structured pruning: heads, key/value groups and MLP channels really leave the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from optc.calibrate.hessian import HessianAccumulator
from optc.compress.structured import (
    channel_importance,
    head_importance,
    keep_lowest_removed,
    reconstruct,
    select_heads,
)
from optc.data import CalibrationConfig
from optc.errors import OptcError
from optc.methods import METHODS, Workspace
from optc.testing import tiny_model, tiny_tokens


def _workspace(arch: str) -> Workspace:
    ws = Workspace(tiny_model(arch), None, CalibrationConfig(samples=8, seqlen=32, batch_size=4))
    ws._ids = tiny_tokens(n=8, seqlen=32)
    return ws


def _structured(ws: Workspace, **cfg) -> dict:
    config_cls, fn = METHODS["structured"].config, METHODS["structured"].run
    return fn(ws, config_cls.model_validate({"type": "structured", "latency_tokens": 0, **cfg}))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


CASES = [
    ("llama", {"heads": 0.34, "mlp": 0.25}, {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 150}),
    ("llama", {"kv_heads": 0.5}, {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16}),
    ("qwen2", {"heads": 0.34, "mlp": 0.3}, {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 140}),
    ("mistral", {"heads": 0.67}, {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16}),
    ("opt", {"mlp": 0.3}, {"ffn_dim": 140}),
    ("gpt2", {"mlp": 0.25}, {"n_inner": 288}),
]


@pytest.mark.parametrize(("arch", "cfg", "shapes"), CASES, ids=[f"{a}-{'-'.join(c)}" for a, c, _ in CASES])
def test_pruned_model_reloads_in_transformers_with_new_shapes(
    tmp_path: Path, arch: str, cfg: dict, shapes: dict
) -> None:
    ws = _workspace(arch)
    ids = tiny_tokens(n=3, seqlen=20, seed=5)
    stats = _structured(ws, **cfg)
    assert stats["config"] == shapes
    assert 0 < stats["parameters_removed"] == stats["parameters_before"] - stats["parameters_after"]
    in_memory = _logits(ws.model, ids)
    ws.model.save_pretrained(tmp_path)
    saved = AutoConfig.from_pretrained(tmp_path)
    for key, value in shapes.items():
        assert getattr(saved, key) == value
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert sum(p.numel() for p in reloaded.parameters()) == sum(p.numel() for p in ws.model.parameters())
    torch.testing.assert_close(_logits(reloaded, ids), in_memory, atol=1e-5, rtol=1e-5)


def test_pruning_keeps_the_most_important_units_and_reconstruction_helps() -> None:
    ids = tiny_tokens(n=8, seqlen=32)
    errs = {}
    for rec in (False, True):
        ws = _workspace("llama")
        ref = _logits(ws.model, ids)
        _structured(ws, mlp=0.3, heads=0.34, reconstruct=rec)
        errs[rec] = float((_logits(ws.model, ids) - ref).pow(2).mean())
    assert errs[True] < errs[False]


def test_importance_and_reconstruction_kernels() -> None:
    g = torch.Generator().manual_seed(0)
    X = torch.randn(2000, 8, generator=g)
    X[:, 3] *= 0.01  # a channel that barely fires
    W = torch.randn(5, 8, generator=g)
    acc = HessianAccumulator(8)
    acc.add(X)
    H = acc.H
    imp = channel_importance(W, H)
    expected = (W[None] * X[:, None, :]).pow(2).sum(1).mean(0)  # E ||W[:, j] x_j||^2
    torch.testing.assert_close(imp, expected, rtol=1e-4, atol=1e-6)
    assert keep_lowest_removed(imp, 1).tolist() == [0, 1, 2, 4, 5, 6, 7]
    heads = head_importance(W, H, 2)
    torch.testing.assert_close(heads, torch.stack([(X[:, 2 * h : 2 * h + 2] @ W[:, 2 * h : 2 * h + 2].T).pow(2).sum(1).mean() for h in range(4)]), rtol=1e-4, atol=1e-6)
    # Correlated inputs: the refit on the kept columns beats dropping the column outright.
    Xc = X.clone()
    Xc[:, 0] = Xc[:, 1] + 0.1 * Xc[:, 0]
    acc = HessianAccumulator(8)
    acc.add(Xc)
    keep = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    refit = reconstruct(W, acc.H, keep, dampening=1e-6)
    err_drop = float((Xc @ W.T - Xc[:, keep] @ W[:, keep].T).pow(2).mean())
    err_refit = float((Xc @ W.T - Xc[:, keep] @ refit.T).pow(2).mean())
    assert err_refit < 0.1 * err_drop


def test_head_selection_keeps_groups_equal() -> None:
    imp = torch.tensor([5.0, 1.0, 3.0, 0.5, 9.0, 2.0])  # 2 kv groups of 3 query heads
    q, kv = select_heads(imp, 2, remove_per_group=1)
    assert q.tolist() == [0, 2, 4, 5] and kv.tolist() == [0, 1]
    q, kv = select_heads(imp, 2, remove_groups=1)
    assert q.tolist() == [3, 4, 5] and kv.tolist() == [1]  # group 1 totals 11.5 > 9


@pytest.mark.parametrize(("arch", "cfg", "message"), [
    ("llama", {"heads": 0.9}, "every query head"),
    ("llama", {"kv_heads": 0.9}, "every head"),
    ("llama", {"heads": 0.1}, "removes no head"),
    ("llama", {"mlp": 0.999}, "every MLP channel"),
    ("opt", {"heads": 0.5}, "head pruning is not available"),
    ("gpt2", {"heads": 0.5}, "head pruning is not available"),
])
def test_impossible_structures_are_refused_before_any_change(arch: str, cfg: dict, message: str) -> None:
    ws = _workspace(arch)
    before = {k: v.clone() for k, v in ws.model.state_dict().items()}
    with pytest.raises(OptcError, match=message):
        _structured(ws, **cfg)
    after = ws.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_config_refuses_nothing_to_remove_and_out_of_range() -> None:
    config_cls = METHODS["structured"].config
    for bad in ({}, {"heads": 1.0}, {"mlp": -0.1}):
        with pytest.raises(ValueError):
            config_cls.model_validate({"type": "structured", **bad})


def test_structured_after_pruning_slices_masks_and_before_quantization_only() -> None:
    ws = _workspace("llama")
    config_cls, fn = METHODS["wanda"].config, METHODS["wanda"].run
    fn(ws, config_cls.model_validate({"type": "wanda", "sparsity": 0.5}))
    stats = _structured(ws, mlp=0.25, heads=0.34)
    up = ws.model.get_submodule("model.layers.0.mlp.up_proj")
    down = ws.model.get_submodule("model.layers.0.mlp.down_proj")
    assert ws.masks["model.layers.0.mlp.up_proj"].shape == up.weight.shape == (150, 96)
    assert ws.masks["model.layers.0.mlp.down_proj"].shape == down.weight.shape == (96, 150)
    assert not down.weight[~ws.masks["model.layers.0.mlp.down_proj"]].any()  # refit did not regrow
    assert stats["parameters_removed_fraction"] > 0.1
    config_cls, fn = METHODS["rtn"].config, METHODS["rtn"].run
    fn(ws, config_cls.model_validate({"type": "rtn"}))
    with pytest.raises(OptcError, match="before quantization"):
        _structured(ws, mlp=0.25)


def test_latency_is_measured_and_reported() -> None:
    ws = _workspace("llama")
    stats = _structured(ws, mlp=0.5, latency_tokens=32)
    assert stats["latency_ms_before"] > 0 and stats["latency_ms_after"] > 0
    assert stats["speedup"] == pytest.approx(stats["latency_ms_before"] / stats["latency_ms_after"], rel=0.01)
    assert "parameters" in stats["notes"][0] and "ms" in stats["notes"][0]

"""Pruning the real default model: a quick structured check, and the fixed-protocol targets
(``slow``: each costs a full calibration and a 40-window evaluation)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from optc.model.anatomy import select_linears, weight_2d
from optc.compress.masks import nm_violations
from optc.data import CalibrationConfig, evaluation_tokens
from optc.evaluate.perplexity import perplexity
from optc.export.checkpoint import directory_bytes
from optc.methods import METHODS, Workspace

pytestmark = pytest.mark.real_model

DATA = Path(os.environ.get("OPTC_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
CALIB, TEST = DATA / "wikitext-2-valid.txt", DATA / "wikitext-2-raw-test.txt"


def _stage(ws: Workspace, **cfg) -> dict:
    config_cls, fn = METHODS[cfg["type"]].config, METHODS[cfg["type"]].run
    return fn(ws, config_cls.model_validate(cfg))


def test_structured_pruning_shrinks_the_real_model(default_model, tmp_path: Path) -> None:
    model = copy.deepcopy(default_model.model)
    ws = Workspace(model, default_model.tokenizer, CalibrationConfig(samples=4, seqlen=128))
    stats = _stage(ws, type="structured", heads=0.25, mlp=0.25, latency_tokens=0)
    assert stats["config"] == {"head_dim": 64, "num_attention_heads": 6, "num_key_value_heads": 3,
                               "intermediate_size": 1152}
    dense_dir, pruned_dir = tmp_path / "dense", tmp_path / "pruned"
    default_model.model.save_pretrained(dense_dir)
    model.save_pretrained(pruned_dir)
    assert directory_bytes(pruned_dir) < 0.85 * directory_bytes(dense_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(pruned_dir).eval()
    ids = torch.arange(40)[None, :] * 37 % 1000
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)


def _fixed_protocol(default_model, **stage) -> float:
    if not (CALIB.is_file() and TEST.is_file()):
        pytest.skip(f"WikiText-2 files not found under {DATA} (set OPTC_DATA)")
    model = copy.deepcopy(default_model.model)
    ws = Workspace(model, default_model.tokenizer, CalibrationConfig(dataset=str(CALIB), samples=128, seqlen=512))
    stats = _stage(ws, **stage)
    assert stats["nm_violations"] == 0
    for name, module in select_linears(model, [".*"], ["lm_head"]).items():
        assert nm_violations(weight_2d(module), 2, 4) == 0, name
    return perplexity(model, evaluation_tokens(default_model.tokenizer, str(TEST)), 2048, 40).perplexity


@pytest.mark.slow
def test_sparsegpt_2of4_target(default_model) -> None:
    from optc.recipe import load_recipe

    stage = load_recipe("prune-2of4-sparsegpt").stages[0].model_dump()
    assert _fixed_protocol(default_model, **stage) <= 66


@pytest.mark.slow
def test_wanda_2of4_target(default_model) -> None:
    from optc.recipe import load_recipe

    stage = load_recipe("prune-2of4-wanda").stages[0].model_dump()
    assert _fixed_protocol(default_model, **stage) <= 150.6

"""The real default model (SmolLM2-135M): the numbers the tiny models cannot check."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from optc.data import evaluation_tokens
from optc.evaluate.perplexity import perplexity
from optc.export.checkpoint import write_dense
from optc.model.load import LoadedModel
from optc.methods import Workspace
from optc.methods.rtn import RTNStage, run_rtn

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def eval_tokens(default_model: LoadedModel) -> torch.Tensor:
    return evaluation_tokens(default_model.tokenizer, "builtin")


@pytest.fixture(scope="module")
def baseline_ppl(default_model: LoadedModel, eval_tokens: torch.Tensor) -> float:
    return perplexity(default_model.model, eval_tokens, seqlen=256, windows=2).perplexity


@pytest.fixture(scope="module")
def rtn_model(default_model: LoadedModel) -> torch.nn.Module:
    model = copy.deepcopy(default_model.model)
    stage = RTNStage(type="rtn", scheme={"bits": 4, "group_size": 64})
    stats = run_rtn(Workspace(model, default_model.tokenizer), stage)
    assert len(stats["modules"]) == 30 * 7  # every decoder Linear of the 30 layers
    return model


def test_default_model_perplexity(default_model: LoadedModel, baseline_ppl: float) -> None:
    assert default_model.model.config.model_type == "llama"
    assert 1 < baseline_ppl < 100 and math.isfinite(baseline_ppl)


def test_rtn_4bit_moderate_loss(rtn_model, default_model: LoadedModel, eval_tokens, baseline_ppl: float) -> None:
    ppl = perplexity(rtn_model, eval_tokens, seqlen=256, windows=2).perplexity
    assert baseline_ppl < ppl < 2 * baseline_ppl
    # The shared session model was not touched by the deep copy's compression.
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(rtn_model.get_parameter(name), default_model.model.get_parameter(name))


def test_dense_export_reloads_with_same_logits(rtn_model, default_model: LoadedModel, tmp_path: Path) -> None:
    write_dense(rtn_model, default_model.tokenizer, tmp_path / "ckpt")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    ids = default_model.tokenizer("The capital of France is Paris, and", return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (reloaded(ids).logits - rtn_model(ids).logits).abs().max()
    assert diff < 1e-4

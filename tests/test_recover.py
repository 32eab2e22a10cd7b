"""Recovery (LoRA + distillation): masks and grids kept, exact merge, resume, peft format."""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager

import pytest
import torch
from typer.testing import CliRunner

from optc.model.anatomy import select_linears, weight_2d
from optc.cli.main import app
from optc.compress.lora import kd_loss, kd_loss_topk, kl_to, lora_delta, topk_logits
from optc.compress.masks import nm_violations
from optc.compress.quant import fake_quantize, quantize
from optc.recipe import parse_recipe
from optc.methods import Workspace
from optc.methods.common import activation_checkpointing
from optc.methods.magnitude import MagnitudeStage, run_magnitude
from optc.methods.recover import RecoverStage, run_recover
from optc.methods.rtn import RTNStage, run_rtn
from optc.testing import tiny_model, tiny_tokens
from optc.methods.recover_training import attach_adapters, merge_adapters, train_adapters

runner = CliRunner()


def _cfg(**kw) -> RecoverStage:
    base = {"type": "recover", "steps": 4, "lr": 1e-2, "rank": 4, "alpha": 8, "batch_size": 2, "save_every": 0}
    return RecoverStage(**{**base, **kw})


def _pruned_tiny(arch: str = "llama"):
    model = tiny_model(arch)
    teacher = copy.deepcopy(model)
    ws = Workspace(model, tokenizer=None)
    run_magnitude(ws, MagnitudeStage(type="magnitude", pattern="2:4"))
    return ws, teacher


def _train(ws: Workspace, teacher, cfg: RecoverStage, state_dir=None, progress=None):
    linears = select_linears(ws.model, cfg.targets, cfg.ignore)
    wrappers = attach_adapters(ws.model, linears, cfg, ws.masks, ws.qparams)
    run = train_adapters(ws.model, wrappers, teacher, tiny_tokens(8, 32), cfg, state_dir, progress)
    tensors = {n: (w.lora_A.detach().clone(), w.lora_B.detach().clone(), w.scaling) for n, w in wrappers.items()}
    stats, _ = merge_adapters(ws.model, wrappers, keep_base=False)
    return run, tensors, stats, linears


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gpt2: Conv1D stores W transposed
def test_masks_intact_after_merge(arch):
    ws, teacher = _pruned_tiny(arch)
    run, _, stats, linears = _train(ws, teacher, _cfg(loss="mix"))
    moved = 0
    for name, module in linears.items():
        w = weight_2d(module).detach()
        assert nm_violations(w, 2, 4) == 0
        moved += int((w[~ws.masks[name]] != 0).sum())
    assert moved == 0
    assert max(s["delta_rel"] for s in stats.values()) > 0  # the kept weights did train
    assert not any("LoraLinear" in type(m).__name__ for m in ws.model.modules())


def test_merged_equals_base_plus_delta():
    model = tiny_model("llama")
    before = {n: weight_2d(m).detach().clone() for n, m in select_linears(model, [".*"], ["lm_head"]).items()}
    ws = Workspace(model, tokenizer=None)
    _, tensors, _, linears = _train(ws, copy.deepcopy(model), _cfg(loss="ce"))
    for name, module in linears.items():
        a, b, s = tensors[name]
        assert torch.count_nonzero(b) > 0
        assert torch.equal(weight_2d(module).detach(), before[name] + lora_delta(a, b, s))


def test_quantized_merge_stays_on_grid():
    model = tiny_model("llama")
    ws = Workspace(model, tokenizer=None)
    run_rtn(ws, RTNStage(type="rtn"))
    before = {n: weight_2d(m).detach().clone() for n, m in select_linears(model, [".*"], ["lm_head"]).items()}
    _, tensors, stats, linears = _train(ws, None, _cfg(loss="ce", lr=5e-2, steps=6))
    changed = 0
    for name, module in linears.items():
        w, p = weight_2d(module).detach(), ws.qparams[name]
        a, b, s = tensors[name]
        assert torch.equal(w, fake_quantize(before[name] + lora_delta(a, b, s), p))
        assert torch.equal(fake_quantize(w, p), w)  # exactly on the stage's grid
        changed += int((quantize(w, p) != quantize(before[name], p)).sum())
    assert changed > 0  # the grid-aware update moved some codes


def test_distillation_loss_decreases():
    ws, teacher = _pruned_tiny()
    run, *_ = _train(ws, teacher, _cfg(loss="kd", steps=30, lr=1e-2))
    assert run["loss_end"] < 0.7 * run["loss_start"]


def test_topk_distillation_matches_full_with_whole_vocabulary():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    values, index = topk_logits(teacher, 11)
    full = kd_loss(student, teacher, 2.0)
    assert torch.allclose(kd_loss_topk(student, values.float(), index, 2.0), full, atol=1e-2)
    assert kd_loss(teacher, teacher) == pytest.approx(0.0, abs=1e-6)


def test_kl_to_is_the_kl_divergence_and_trains_the_student_only():
    g = torch.Generator().manual_seed(1)
    s_logits = torch.randn(3, 7, 13, generator=g).requires_grad_(True)
    t_logits = torch.randn(3, 7, 13, generator=g).requires_grad_(True)
    s_logp, t_logp = s_logits.log_softmax(-1), t_logits.log_softmax(-1)
    plain = torch.nn.functional.kl_div(s_logp, t_logp, log_target=True, reduction="sum")
    total = kl_to(s_logp, t_logp, "sum")
    assert torch.allclose(total, plain, rtol=1e-5)
    assert torch.allclose(kl_to(s_logp, t_logp), plain / 21, rtol=1e-5)
    total.backward()
    assert t_logits.grad is None and s_logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="reduction"):
        kl_to(s_logp, t_logp, "none")


def test_activation_checkpointing_is_on_within_and_keeps_the_gradients(caplog):
    model = tiny_model("llama").train()
    ids = tiny_tokens(2, 16)

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain = grads()
    with activation_checkpointing(model) as on:
        assert on and model.is_gradient_checkpointing
        recomputed = grads()
    assert not model.is_gradient_checkpointing
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, recomputed))
    with activation_checkpointing(model, enabled=False) as on:
        assert not on and not model.is_gradient_checkpointing
    with activation_checkpointing(torch.nn.Linear(2, 2)) as on:
        assert not on
    assert "does not support activation checkpointing" in caplog.text


def test_recovery_with_activation_checkpointing_trains_alike():
    runs = []
    for checkpointing in (False, True):
        ws, teacher = _pruned_tiny()
        run, tensors, *_ = _train(ws, teacher, _cfg(loss="kd", steps=3, gradient_checkpointing=checkpointing))
        runs.append((run, tensors))
        assert not ws.model.is_gradient_checkpointing
    (plain, a), (recomputed, b) = runs
    assert recomputed["loss_end"] == pytest.approx(plain["loss_end"], rel=1e-4)
    assert all(torch.allclose(a[n][1], b[n][1], atol=1e-5) for n in a)


class _InterruptAfter:
    """A progress whose advance raises KeyboardInterrupt after ``n`` steps (a user's ^C)."""

    def __init__(self, n: int) -> None:
        self.n = n

    @contextmanager
    def task(self, description, total):
        count = [0]

        def advance(info=None):
            count[0] += 1
            if count[0] == self.n:
                raise KeyboardInterrupt

        yield advance


def test_resume_matches_uninterrupted(tmp_path):
    cfg = _cfg(loss="mix", steps=6, save_every=2, dropout=0.0)
    ws1, teacher = _pruned_tiny()
    _train(ws1, teacher, cfg)

    ws2, teacher2 = _pruned_tiny()
    with pytest.raises(KeyboardInterrupt):
        _train(ws2, teacher2, cfg, state_dir=tmp_path, progress=_InterruptAfter(5))
    assert (tmp_path / "state.safetensors").is_file()  # saved at step 4
    ws3, teacher3 = _pruned_tiny()
    run, *_ = _train(ws3, teacher3, cfg.model_copy(update={"resume": True}), state_dir=tmp_path)
    assert run["resumed_at"] == 4 and run["steps"] == 6
    for (n1, p1), (n3, p3) in zip(ws1.model.state_dict().items(), ws3.model.state_dict().items()):
        assert n1 == n3 and torch.equal(p1, p3), n1
    assert not (tmp_path / "state.safetensors").exists()  # finished: nothing left to resume


def test_resume_refuses_other_settings(tmp_path):
    cfg = _cfg(loss="ce", steps=4, save_every=2)
    ws, _ = _pruned_tiny()
    with pytest.raises(KeyboardInterrupt):
        _train(ws, None, cfg, state_dir=tmp_path, progress=_InterruptAfter(3))
    ws, _ = _pruned_tiny()
    from optc.errors import OptcError

    with pytest.raises(OptcError, match="different recovery run"):
        _train(ws, None, cfg.model_copy(update={"resume": True, "lr": 0.5}), state_dir=tmp_path)


def _recipe(tiny_checkpoint, stages, fmt="dense", evaluation=None):
    return parse_recipe({
        "version": 1, "model": str(tiny_checkpoint),
        "calibration": {"dataset": "builtin", "samples": 4, "seqlen": 64},
        "stages": stages, "evaluation": evaluation, "export": {"format": fmt},
    })


def test_adapter_export_loads_in_peft(tiny_checkpoint, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from optc.export.load import load_checkpoint as load_model
    from optc.run.pipeline import run_recipe

    stages = [{"type": "rtn", "scheme": {"bits": 4, "group_size": 32}},
              {"type": "recover", "steps": 3, "lr": 1e-2, "rank": 4, "batch_size": 2, "samples": 6,
               "loss": "mix", "export": "adapter"}]
    out = tmp_path / "rec"
    report = run_recipe(_recipe(tiny_checkpoint, stages, "compressed-tensors"), out)
    assert report["checkpoint"]["adapter"] == ["adapter_config.json", "adapter_model.safetensors"]
    rec = report["stages"][1]["stats"]
    assert rec["export"] == "adapter" and rec["steps"] == 3
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "LORA"
    # The checkpoint holds the quantized weights; peft adds the adapter on top of them.
    base = load_model(str(out)).model
    peft_model = PeftModel.from_pretrained(base, str(out)).eval()
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = peft_model(input_ids=ids).logits
        plain = load_model(str(out)).model(input_ids=ids).logits
    # The recovered model as evaluated: quantized base + adapter, merged in float.
    merged = load_model(str(out)).model
    state = load_file(str(out / "adapter_model.safetensors"))
    with torch.no_grad():
        for key, a in state.items():
            if key.endswith("lora_A.weight"):
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = state[key.replace("lora_A", "lora_B")]
                merged.get_submodule(name).weight += b @ a * (32.0 / 4)
        want = merged(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(got, plain, atol=1e-4)  # the adapter does something


def test_recover_stage_in_recipe_keeps_2of4(tiny_checkpoint, tmp_path):
    from optc.run.pipeline import run_recipe

    stages = [{"type": "magnitude", "pattern": "2:4"},
              {"type": "recover", "steps": 2, "rank": 4, "batch_size": 2, "samples": 4}]
    report = run_recipe(_recipe(tiny_checkpoint, stages), tmp_path / "out")
    rec = report["stages"][1]["stats"]
    assert rec["pruned_weights_moved"] == 0 and rec["nm_violations"] == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"]["sparsity_config"]["sparsity_structure"] == "2:4"


@pytest.mark.parametrize("flags, message", [
    (["--target", "nothing_matches_this"], "match no Linear"),
    (["--rank", "100"], "rank 100 is larger"),
    (["--steps", "0"], "greater than 0"),
    (["--lr", "0"], "greater than 0"),
    (["--lr", "-1e-3"], "greater than 0"),
])
def test_bad_input(tiny_checkpoint, tmp_path, flags, message):
    out = tmp_path / "out"
    result = runner.invoke(app, ["recover", str(tiny_checkpoint), "--output", str(out), "--no-eval", "-q",
                                 "--steps", "2", *flags])
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []  # no output, no partial directory, no state


def test_cli_recover_resume_without_state(tiny_checkpoint, tmp_path):
    result = runner.invoke(app, ["recover", str(tiny_checkpoint), "--output", str(tmp_path / "o"), "--no-eval",
                                 "-q", "--steps", "2", "--samples", "4", "--resume", "--loss", "ce"])
    assert result.exit_code == 1 and "no saved recovery state" in result.output


def test_recover_a_pruned_checkpoint_keeps_its_zeros(tiny_checkpoint, tmp_path):
    from optc.export.load import load_checkpoint as load_model
    from optc.run.pipeline import run_recipe

    run_recipe(_recipe(tiny_checkpoint, [{"type": "magnitude", "pattern": "2:4"}]), tmp_path / "sparse")
    loaded = load_model(str(tmp_path / "sparse"))
    assert loaded.nm == (2, 4) and len(loaded.masks) == 14
    stages = [{"type": "recover", "steps": 2, "rank": 4, "batch_size": 2, "samples": 4, "lr": 1e-2}]
    eval_cfg = {"dataset": "builtin", "seqlen": 64, "windows": 2}
    report = run_recipe(_recipe(tmp_path / "sparse", stages, evaluation=eval_cfg), tmp_path / "rec")
    rec = report["stages"][0]["stats"]
    assert rec["pruned_weights_moved"] == 0 and rec["nm_violations"] == 0
    assert report["baseline"] == str(tiny_checkpoint)  # the teacher: the model recipe.yaml names
    assert str(tiny_checkpoint) in (tmp_path / "rec" / "recipe.yaml").read_text()  # found again later
    m = report["metrics"]
    # baseline = the float teacher, before = the pruned checkpoint, compressed = recovered
    assert m["perplexity_baseline"]["perplexity"] != m["perplexity_before_recovery"]["perplexity"]
    assert m["perplexity_before_recovery"]["window_nll"] != m["perplexity_compressed"]["window_nll"]
    after = load_model(str(tmp_path / "rec")).model
    for name, mask in loaded.masks.items():
        w = after.get_submodule(name).weight.detach()
        assert torch.equal(w[~mask], torch.zeros_like(w[~mask]))
        assert not torch.equal(w, loaded.model.get_submodule(name).weight.detach())


def test_rtn_recovery_starts_from_the_float_weights():
    from optc.methods.recover_training import float_latents

    model = tiny_model("llama")
    teacher = copy.deepcopy(model)
    ws = Workspace(model, tokenizer=None)
    run_rtn(ws, RTNStage(type="rtn"))
    linears = select_linears(model, [".*"], ["lm_head"])
    latents = float_latents(teacher, linears, ws.qparams)
    assert set(latents) == set(linears)  # RTN: rounding the float weights gives the checkpoint
    before = {n: weight_2d(m).detach().clone() for n, m in linears.items()}
    wrappers = attach_adapters(model, linears, _cfg(), ws.masks, ws.qparams, latents)
    for name, wrap in wrappers.items():  # B = 0: exactly the quantized model
        assert torch.equal(wrap.effective_weight().detach(), before[name])
    train_adapters(model, wrappers, teacher, tiny_tokens(8, 32), _cfg(loss="kd", steps=2, lr=1e-3), None)
    stats, _ = merge_adapters(model, wrappers, keep_base=False)
    assert sum(s["codes_changed"] for s in stats.values()) > 0  # small updates already flip codes
    for name, module in linears.items():
        w = weight_2d(module).detach()
        assert torch.equal(fake_quantize(w, ws.qparams[name]), w)

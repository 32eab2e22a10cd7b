"""Compress to a budget: the knapsack kernel, the config, and runs on a tiny Llama."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from optc.cli.main import app
from optc.compress.allocate import allocate, output_error
from optc.export.load import load_checkpoint
from optc.methods.base import CANDIDATE_SETS, Budget


def _brute(err: torch.Tensor, size: torch.Tensor, budget: int) -> float:
    best = float("inf")
    for pick in itertools.product(range(err.shape[1]), repeat=err.shape[0]):
        if sum(int(size[l, s]) for l, s in enumerate(pick)) <= budget:
            best = min(best, sum(float(err[l, s]) for l, s in enumerate(pick)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_allocation_is_the_exact_optimum(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    L, S = 6, 3
    size = torch.randint(1, 12, (L, S), generator=g) * 8
    err = torch.rand(L, S, generator=g, dtype=torch.float64)
    budget = int(size.min(dim=1).values.sum()) + int(torch.randint(0, 60, (1,), generator=g))
    pick = allocate(err, size, budget)
    used = int(size[torch.arange(L), pick].sum())
    assert used <= budget
    assert float(err[torch.arange(L), pick].sum()) == pytest.approx(_brute(err, size, budget))


def test_disallowed_candidates_and_coarse_units_stay_under_budget() -> None:
    g = torch.Generator().manual_seed(0)
    L, S = 40, 4
    # Sizes with no useful common divisor and a budget of billions of bits: the sizes are rounded
    # up to coarser units, which may lose optimality but never exceed the budget.
    size = torch.randint(10**7, 10**8, (L, S), generator=g) + torch.arange(S)
    err = torch.rand(L, S, generator=g, dtype=torch.float64)
    err[:, 0] = float("inf")  # never allowed
    budget = int(size[:, 1:].min(dim=1).values.sum()) + 10**9
    pick = allocate(err, size, budget)
    assert int(size[torch.arange(L), pick].sum()) <= budget and bool((pick != 0).all())
    with pytest.raises(ValueError, match="more than the budget"):
        allocate(err, size, int(size.min(dim=1).values.sum()) - 1)


def test_more_budget_never_costs_accuracy() -> None:
    g = torch.Generator().manual_seed(3)
    size = torch.tensor([[2, 3, 4, 8]] * 10) * 1000
    err = torch.sort(torch.rand(10, 4, generator=g, dtype=torch.float64), dim=1, descending=True).values
    totals = [float(err[torch.arange(10), allocate(err, size, b * 1000)].sum()) for b in range(20, 81, 5)]
    assert totals == sorted(totals, reverse=True)


def test_output_error_is_the_output_energy_of_the_weight_error() -> None:
    g = torch.Generator().manual_seed(0)
    X = torch.randn(200, 16, generator=g, dtype=torch.float64)
    dW = torch.randn(5, 16, generator=g, dtype=torch.float64)
    gamma = torch.rand(5, generator=g, dtype=torch.float64)
    H = X.T @ X
    assert output_error(dW, H) == pytest.approx(float(((X @ dW.T) ** 2).sum()))
    assert output_error(dW, H, gamma) == pytest.approx(float((((X @ dW.T) ** 2) * gamma).sum()))


@pytest.mark.parametrize("kw, message", [
    ({}, "exactly one of bits_per_weight and size"),
    ({"bits_per_weight": 3, "size": "1MB"}, "exactly one of bits_per_weight and size"),
    ({"bits_per_weight": 1.5}, "outside what the candidates reach"),
    ({"bits_per_weight": 17}, "outside what the candidates reach"),
    ({"bits_per_weight": 3, "candidates": []}, "candidates is empty"),
    ({"bits_per_weight": 3, "candidates": [None, None]}, "repeat a scheme"),
    ({"bits_per_weight": 3, "typo": 1}, "typo"),
    ({"bits_per_weight": 3, "candidates": "asym"}, "(?s)candidates.*neither a list of schemes nor a candidate set "
                                                    "\\(symmetric, asymmetric, gguf\\)"),
])
def test_bad_budgets_are_refused_by_the_config(kw: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Budget(**kw)


def test_named_candidate_sets() -> None:
    assert Budget(bits_per_weight=3.25).candidates == CANDIDATE_SETS["symmetric"]()
    asym = Budget(bits_per_weight=3.25, candidates="asymmetric").candidates
    assert asym == CANDIDATE_SETS["asymmetric"]()
    assert any(c is not None and not c.symmetric for c in asym)
    assert len({c.label() for c in asym if c is not None}) == len(asym)


def _recipe(tmp: Path, budget: dict, fmt: str = "compressed-tensors", **stage) -> str:
    data = {
        "version": 1, "name": "budget",
        "calibration": {"dataset": "builtin", "samples": 4, "seqlen": 32},
        "stages": [{"type": "gptq", "budget": budget, **stage}],
        "export": {"format": fmt},
    }
    path = tmp / "budget.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return str(path)


def _run(recipe: str, model: Path, out: Path, *extra: str):
    return CliRunner().invoke(app, ["run", recipe, "--model", str(model), "--no-eval", "-q", "--output", str(out),
                                    *extra])


def test_bits_per_weight_budget_end_to_end(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The achieved average is at or under the target, and exactly what the checkpoint stores;
    every Linear is written on the scheme the allocation gave it; an override stays."""
    recipe = _recipe(tmp_path, {"bits_per_weight": 5.5},
                     overrides=[{"pattern": "down_proj", "scheme": {"bits": 8, "group_size": 64}}])
    out = tmp_path / "out"
    result = _run(recipe, tiny_checkpoint, out)
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((out / "report.json").read_text())
    stage = report["stages"][0]
    budget = stage["stats"]["budget"]
    assert budget["bits_per_weight"] <= 5.5
    assert budget["observer"] == "mse"  # GPTQ's own grid search
    assert report["metrics"]["size"]["linear_bits_per_weight"] == pytest.approx(budget["bits_per_weight"], abs=1e-4)
    modules = stage["stats"]["modules"]
    assert all(m["scheme"] == "int8-sym-g64" for n, m in modules.items() if "down_proj" in n)
    assert sum(budget["schemes"].values()) == sum("down_proj" not in n for n in modules)
    assert "budget: " in stage["summary"]
    assert "Schemes chosen by the budget (gptq):" in (out / "report.md").read_text()
    # optc's reader of the written checkpoint (down_proj's 160 columns store group 64 as groups of 32)
    read = load_checkpoint(str(out)).qparams
    assert {n: read[n].scheme.bits for n in modules} == {n: int(m["scheme"][3]) for n, m in modules.items()}
    assert budget["fused_sets"] == 0  # each Linear its own scheme unless fused: true


def test_fused_budget_gives_vllm_fused_shards_one_scheme(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """--fused (the budget's fused: true): each layer's q/k/v_proj and gate/up_proj take one scheme
    (vLLM loads them as one module each)."""
    out = tmp_path / "out"
    result = _run(_recipe(tmp_path, {"bits_per_weight": 5.5}), tiny_checkpoint, out, "--fused")
    assert result.exit_code == 0, (result.output, result.exception)
    stage = json.loads((out / "report.json").read_text())["stages"][0]
    budget, modules = stage["stats"]["budget"], stage["stats"]["modules"]
    assert budget["fused_sets"] == 4 and budget["bits_per_weight"] <= 5.5
    for layer in range(2):
        for shards in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            kind = "self_attn" if "q_proj" in shards else "mlp"
            assert len({modules[f"model.layers.{layer}.{kind}.{s}"]["scheme"] for s in shards}) == 1


def test_fused_groups() -> None:
    from optc.model.patterns import fused_groups

    names = ["a.0.self_attn.q_proj", "a.0.self_attn.k_proj", "a.0.self_attn.o_proj", "a.1.self_attn.q_proj",
             "a.0.self_attn.v_proj", "a.0.mlp.gate_proj", "a.0.mlp.up_proj", "a.0.mlp.down_proj"]
    assert fused_groups(names) == [
        ["a.0.self_attn.q_proj", "a.0.self_attn.k_proj", "a.0.self_attn.v_proj"], ["a.0.self_attn.o_proj"],
        ["a.1.self_attn.q_proj"], ["a.0.mlp.gate_proj", "a.0.mlp.up_proj"], ["a.0.mlp.down_proj"]]


def test_size_budget_and_cli_flag(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["quantize", "--recipe", "w4a16-gptq", "--model", str(tiny_checkpoint), "--samples", "4", "--seqlen", "32",
            "--no-eval", "-q", "--output", str(out), "--target-size", "12.2MiB"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((out / "report.json").read_text())
    budget = report["stages"][0]["stats"]["budget"]
    assert budget["bytes"] <= 12.2 * 2**20 and budget["target_bytes"] == int(12.2 * 2**20)
    assert report["metrics"]["size"]["weight_bytes"] == pytest.approx(budget["bytes"], rel=1e-4)


def _independent_reader():
    """bench/hf_ppl.py: decodes each module with compressed-tensors and its own config group."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_ppl", Path(__file__).parents[1] / "bench" / "hf_ppl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_asymmetric_candidates_from_the_cli(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """--candidates asymmetric: a mix of asymmetric and symmetric groups, at or under the target,
    which compressed-tensors' own decompressor, module by module, reads as optc wrote it."""
    out = tmp_path / "out"
    args = ["quantize", "--recipe", "w4a16-gptq", "--model", str(tiny_checkpoint), "--samples", "4", "--seqlen", "32",
            "--no-eval", "-q", "--output", str(out), "--target-bpw", "4", "--candidates", "asymmetric"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    budget = json.loads((out / "report.json").read_text())["stages"][0]["stats"]["budget"]
    assert budget["bits_per_weight"] <= 4 and "int3-asym-g64" in budget["candidates"]
    assert any("asym" in s for s in budget["schemes"]), budget["schemes"]
    ours = load_checkpoint(str(out))
    theirs = _independent_reader()._per_module(str(out), torch.float32)
    for name, p in ours.qparams.items():
        w = ours.model.get_submodule(name).weight.float()
        assert torch.allclose(theirs.get_submodule(name).weight, w, atol=1e-6), name
    assert any(not p.scheme.symmetric for p in ours.qparams.values())


def test_gguf_budget_types_each_tensor_by_its_scheme(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """--format gguf with the gguf candidates: every decoder Linear in the block type of the scheme
    the allocation gave it, at or under the target as the file stores it; the k-quants, whose
    256-weight super-blocks divide none of the tiny model's rows, never chosen."""
    import gguf

    out = tmp_path / "out"
    args = ["quantize", "--recipe", "w4a16-gptq", "--model", str(tiny_checkpoint), "--samples", "4", "--seqlen", "32",
            "--no-eval", "-q", "--output", str(out), "--target-bpw", "5.2", "--candidates", "gguf", "--format", "gguf"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((out / "report.json").read_text())
    budget = report["stages"][0]["stats"]["budget"]
    assert budget["bits_per_weight"] <= 5.2 and len(budget["schemes"]) > 1, budget
    assert budget["fused_sets"] == 0  # llama.cpp keeps q/k/v and gate/up apart
    assert not any("_k" in s for s in budget["schemes"])
    modules = report["stages"][0]["stats"]["modules"]
    expect = {"int4-sym-g32": "Q4_0", "int4-asym-g32": "Q4_1", "int5-sym-g32": "Q5_0", "int5-asym-g32": "Q5_1",
              "int8-sym-g32": "Q8_0"}
    reader = gguf.GGUFReader(next(out.glob("*.gguf")))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    stored = sum(t.n_bytes * 8 for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2)
    weights = sum(int(t.n_elements) for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2)
    assert stored / weights == pytest.approx(budget["bits_per_weight"], abs=1e-4)
    for name, m in modules.items():
        layer = name.split(".")[2]
        kind = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}[name.rsplit(".", 1)[1]]
        assert types[f"blk.{layer}.{kind}.weight"] == expect[m["scheme"]], name


def test_gptq_budget_writes_per_module_settings(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """--format gptq: the mix goes in GPTQModel's dynamic map; the decoder Linears' tensors as the
    file stores them (codes, zero points, float16 scales, g_idx; float weights of float Linears)
    average exactly the budget's bits per weight, at or under the target; each module's settings,
    by the published first-match rule, are the scheme the allocation gave it."""
    from safetensors.torch import load_file

    from test_formats_gptq import ref_module_setting

    candidates = [{"bits": b, "group_size": 32} for b in (2, 4, 8)] + [None]
    out = tmp_path / "out"
    # q/k/v may differ (GPTQModel loads that; vLLM would not, and the export warns).
    budget = {"bits_per_weight": 4.6, "candidates": candidates}
    result = _run(_recipe(tmp_path, budget, "gptq"), tiny_checkpoint, out)
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((out / "report.json").read_text())
    budget = report["stages"][0]["stats"]["budget"]
    assert budget["fused_sets"] == 0
    assert budget["bits_per_weight"] <= 4.6 and len(budget["schemes"]) > 1, budget
    modules = report["stages"][0]["stats"]["modules"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["dynamic"]
    tensors = load_file(str(out / "model.safetensors"))
    source = load_file(str(tiny_checkpoint / "model.safetensors"))
    linears = [k.removesuffix(".weight") for k, t in source.items() if k.startswith("model.layers.") and t.dim() == 2]
    stored = 0
    for name in linears:
        if name in modules:
            stored += sum(tensors[f"{name}.{t}"].nbytes * 8 for t in ("qweight", "qzeros", "scales", "g_idx"))
            bits, group, sym = ref_module_setting(qc, name)
            assert f"int{bits}-{'sym' if sym else 'asym'}-g{group}" == modules[name]["scheme"], name
        else:
            assert ref_module_setting(qc, name) is None and f"{name}.qweight" not in tensors, name
            stored += tensors[f"{name}.weight"].nbytes * 8
    weights = sum(source[f"{n}.weight"].numel() for n in linears)
    assert stored / weights == pytest.approx(budget["bits_per_weight"], abs=1e-4)


@pytest.mark.parametrize("flags, message", [
    (["--target-bpw", "4", "--format", "gguf"], "GGUF stores int3-sym-g64 in no block type"),
    (["--candidates", "asymmetric"], "give --target-bpw or --target-size too"),
    (["--fused"], "--fused chooses a budget's schemes: give --target-bpw or --target-size too"),
    (["--target-bpw", "4", "--candidates", "asym"], "expected symmetric or asymmetric or gguf"),
])
def test_bad_candidates_flags(tiny_checkpoint: Path, tmp_path: Path, flags: list[str], message: str) -> None:
    args = ["quantize", "--recipe", "w4a16-gptq", "--model", str(tiny_checkpoint), "--no-eval", "-q",
            "--output", str(tmp_path / "out"), *flags]
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0 and message in result.output, result.output


@pytest.mark.parametrize("budget, extra, message", [
    ({"size": "1KB"}, {}, "below the cheapest candidates"),
    ({"bits_per_weight": 15.9, "candidates": [{"bits": 2, "group_size": 64}, None]}, {"_fmt": "compressed-tensors"},
     None),
    ({"bits_per_weight": 4.5, "candidates": [{"bits": 4, "group_size": 32}, {"bits": 4, "group_size": 64}]},
     {"_fmt": "awq"}, "one scheme per checkpoint"),
    ({"bits_per_weight": 3.5}, {"_fmt": "gguf-q4_0"}, "Q4_0 blocks hold"),
    ({"bits_per_weight": 3.5}, {"overrides": [{"pattern": ".*", "scheme": {"bits": 4}}]}, "nothing to choose"),
])
def test_bad_budgets_are_refused_before_calibration(tiny_checkpoint: Path, tmp_path: Path, monkeypatch,
                                                    budget: dict, extra: dict, message: str | None) -> None:
    import optc.methods.budget as budget_module

    def no_calibration(*a, **k):
        raise AssertionError("calibrated before refusing")

    monkeypatch.setattr(budget_module, "candidate_errors", no_calibration)
    fmt = extra.pop("_fmt", "compressed-tensors")
    result = _run(_recipe(tmp_path, budget, fmt, **extra), tiny_checkpoint, tmp_path / "out")
    if message is None:  # feasible: it gets as far as the sensitivity pass
        assert "calibrated before refusing" in repr(result.exception)
        return
    assert result.exit_code != 0
    assert message in result.output, result.output
    assert len(result.output.strip().splitlines()) <= 3


def test_budget_refuses_streaming(tiny_checkpoint: Path, tmp_path: Path) -> None:
    result = _run(_recipe(tmp_path, {"bits_per_weight": 3.25}), tiny_checkpoint, tmp_path / "out", "--streaming")
    assert result.exit_code != 0 and "budget needs the model in memory" in result.output, result.output


def test_output_fisher_is_the_mean_squared_output_gradient() -> None:
    from optc.calibrate.fisher import output_fisher
    from optc.testing import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    name = "model.layers.1.mlp.down_proj"
    module = model.get_submodule(name)
    got = output_fisher(model, ids, {name: module}, batch_size=2)[name]
    kept = []

    def keep(_m, _i, out) -> None:
        out.retain_grad()
        kept.append(out)

    handle = module.register_forward_hook(keep)
    want = torch.zeros_like(got)
    for row in ids:
        kept.clear()
        model.zero_grad()
        loss = model(input_ids=row[None], labels=row[None]).loss * (row.numel() - 1)
        loss.backward()
        want += kept[0].grad.reshape(-1, got.numel()).double().pow(2).sum(dim=0)
    handle.remove()
    torch.testing.assert_close(got, want / ids.numel(), rtol=1e-4, atol=1e-12)
    assert all(p.requires_grad for p in model.parameters())


def test_fisher_sensitivity_runs(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _run(_recipe(tmp_path, {"bits_per_weight": 4.5, "sensitivity": "fisher", "observer": "minmax"}),
                  tiny_checkpoint, out)
    assert result.exit_code == 0, (result.output, result.exception)
    budget = json.loads((out / "report.json").read_text())["stages"][0]["stats"]["budget"]
    assert budget["bits_per_weight"] <= 4.5
    assert budget["observer"] == "minmax"


def test_sweep_writes_the_trade_off(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    args = ["sweep", "w4a16-rtn", "--model", str(tiny_checkpoint), "--samples", "4", "--seqlen", "32",
            "--windows", "1", "--target-bpw", "4.5", "--uniform", "4", "-o", str(out), "-q"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    points = json.loads((out / "sweep.json").read_text())
    assert [p["label"] for p in points] == ["budget-4.5", "uniform-int4"]
    assert points[0]["bits_per_weight"] <= 4.5 < points[1]["bits_per_weight"]
    report = (out / "report.md").read_text()
    assert "| budget-4.5 | budget |" in report and "```text" in report
    assert (out / "uniform-int4" / "model.safetensors").is_file()


def test_pareto_front() -> None:
    from optc.run.sweep import pareto

    pts = [{"bytes": 1, "perplexity": 30}, {"bytes": 2, "perplexity": 20}, {"bytes": 3, "perplexity": 25},
           {"bytes": 2, "perplexity": 20.5}]
    assert pareto(pts) == [True, True, False, False]


def test_output_fisher_in_bfloat16_ranks_as_float32() -> None:
    """The budget's Fisher pass runs in bfloat16 where that is fast: its weights must rank the
    outputs as float32's do."""
    from optc.calibrate.fisher import output_fisher
    from optc.testing import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    names = ["model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"]
    linears = {n: model.get_submodule(n) for n in names}
    full = output_fisher(model, ids, linears)
    half = output_fisher(model, ids, linears, autocast=torch.bfloat16)
    for n in names:
        assert torch.corrcoef(torch.stack([full[n].log(), half[n].log()]))[0, 1] > 0.99
        assert half[n].sum() == pytest.approx(float(full[n].sum()), rel=0.1)


def test_mse_grid_step_is_one_over_grid() -> None:
    """The estimate's coarse search tries shrinks on a 1/grid step only, and never does worse than
    min-max on its own (importance-weighted) objective."""
    from optc.compress.quant import choose_qparams, fake_quantize
    from optc.compress.schemes import QuantScheme

    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 192, generator=g) * (1 + 4 * (torch.rand(48, 192, generator=g) > 0.98))
    scheme = QuantScheme(bits=3, symmetric=True, group_size=64)
    minmax = choose_qparams(w, scheme)
    coarse = choose_qparams(w, scheme, "mse", grid=20)
    shrink = coarse.scale / minmax.scale
    steps = shrink * 20
    assert torch.allclose(steps, steps.round(), atol=1e-3) and bool((shrink <= 1 + 1e-6).all())
    assert bool((shrink < 1 - 1e-6).any())  # outliers: some groups clip
    err = lambda p: float((fake_quantize(w, p) - w).abs().pow(2.4).sum())  # noqa: E731
    assert err(coarse) <= err(minmax)


def test_fused_set_needs_one_candidate_every_shard_can_be_stored_on() -> None:
    """With fused: true, a set whose shards the format stores on no common candidate is refused
    before calibration (here a made-up format: 32-row weights only on int8, 96-row ones only on
    int4; a tiny Llama's q_proj has 96 rows, its k/v_proj 32)."""
    import dataclasses

    from optc.errors import OptcError
    from optc.export.formats import get_format
    from optc.methods.budget import plan_budget
    from optc.methods.gptq import GPTQStage
    from optc.testing import tiny_model

    def stored(scheme, n, k, float_bits, permuted):
        if scheme is None:
            return n * k * float_bits
        allowed = {32: (8,), 96: (4,)}.get(n, (4, 8))
        return n * k * scheme.bits + n * k // 2 if scheme.bits in allowed else None

    fmt = dataclasses.replace(get_format("compressed-tensors"), name="rows", stored_bits=stored)
    model = tiny_model("llama")
    candidates = [{"bits": 4, "group_size": 32}, {"bits": 8, "group_size": 32}]  # no float: no way out
    free = GPTQStage(type="gptq", budget={"bits_per_weight": 6, "candidates": candidates})
    plan = plan_budget(model, free, fmt, 16, {})
    assert len(plan.groups) == len(plan.free)
    fused = GPTQStage(type="gptq", budget={"bits_per_weight": 6, "candidates": candidates, "fused": True})
    with pytest.raises(OptcError, match="fused: one scheme for them"):
        plan_budget(model, fused, fmt, 16, {})

"""Every built-in recipe writes the same bytes: sha256 of ``model.safetensors`` on a tiny Llama.

The pinned hashes are what the recipes wrote before the code was reorganised into the method and
format registries; a change of numerics, tensor order, dtype or layout anywhere along a recipe's
path (calibration, a method's glue, a kernel, a writer) changes one of them. One thread, as the
hashes were taken: BLAS reductions round differently with the thread count. A deliberate change of
a recipe's output updates its hash here, with the reason in the commit.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from optc.cli.main import app
from optc.recipe import builtin_recipes

PINNED = {
    "int8-kl.yaml": "f09a15d6a68cb322165dd8018696cb808644bd71b41ddb42c12e6a7344f166d6",
    "int8-minmax.yaml": "22663443356c328a8e3bd051059a735581206f3ba89950ca8935b7659cadc93d",
    "int8-moving-minmax.yaml": "22663443356c328a8e3bd051059a735581206f3ba89950ca8935b7659cadc93d",
    "int8-mse.yaml": "aefb8416d224cfa3304f617a7493cf6ccfccfaa783fcf57421f2cd917bae8d78",
    "int8-percentile.yaml": "96427e63a72b2ee94fc7c1e2ec9867c9d172f15bb7a676fe316100339df488f0",
    "int8-smoothquant.yaml": "448477f358f9f2040ab90423ab83e36d3af5ac4677603df2127d77b9170b595e",
    "int8.yaml": "7a584dece0c679fff0174cfd181cf4f044daae12b94ba11d9fb4f85eef5af2aa",
    "prune-2of4-magnitude.yaml": "5ae23fe331d959f699f3ebe9285363f16efcbbcf4d9e40e8cfe42cce5ed18d8a",
    "prune-2of4-sparsegpt.yaml": "ce169884c4ebf09958d25787d19cb2f41ef4ef4caffc802103a17cd86141850a",
    "prune-2of4-wanda.yaml": "c98b65c303736ddcab15cbea6c1680cfda12805667eafffe41b019e6356f7d06",
    "prune-50-wanda.yaml": "d49c2268c16cfd50dd491e95e811e5d5e8f03305064b7309c30b61ea68ea96eb",
    "prune-heads.yaml": "e184173e0805859a215e1af4f524fde9f2c89f65e3913b2c19b15f0eec0e2a77",
    "recover.yaml": "567a2a2b83a6de5711684958e069c899b95b9e0ffa467908d93c92308f15f6ae",
    "sparse-2of4-recover.yaml": "2d7234dfa486b883e2aa5af8a29db9a65ee0af5a17b267229f0fb415c2365a26",
    "sparse-2of4-w4a16.yaml": "9e9a5e511b2d0d1182d1bb1434734cd1896114720bb83b41ce3d175cbbc189ea",
    "w4a16-awq.yaml": "f2361880aa51e193cc565039649ce5f2efe80085f30ee865bd20c358260054be",
    "w4a16-gptq.yaml": "f33f6487d1c1c2525111e266f46b18b78df2b83473ffb0e0c8d656c8ccab8b1e",
    "w4a16-rtn-recover.yaml": "6583d3d2d81345823b34486173bafa2b87b5edd480d1551c563d7f55def7fafe",
    "w4a16-rtn.yaml": "561c94cf371b2143ae12dedcd4fc97780ef44d7824fcaf5913be84b68b3bfedd",
    "w8a16-gptq.yaml": "5b1e3d6a5ed264dd0e7bc503119baf8124a8dde95b0c914fce971274ae5c43a8",
}


def _recipe_file(name: str, tmp: Path) -> str:
    """The built-in recipe; a recovery stage gets a two-step budget on four short sequences."""
    data = yaml.safe_load(builtin_recipes()[name].read_text(encoding="utf-8"))
    recover = [s for s in data["stages"] if s["type"] == "recover"]
    if not recover:
        return name
    for stage in recover:
        stage.pop("max_minutes", None)
        stage.pop("tokens", None)
        stage.update(steps=2, samples=4, seqlen=32, batch_size=2)
    path = tmp / f"budget-{name}"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return str(path)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_builtin_recipe_is_pinned():
    assert sorted(builtin_recipes()) == sorted(PINNED)


@pytest.mark.parametrize("name", sorted(PINNED))
def test_recipe_bytes_unchanged(name: str, tiny_checkpoint: Path, tmp_path: Path, one_thread) -> None:
    out = tmp_path / "out"
    args = ["run", _recipe_file(name, tmp_path), "--model", str(tiny_checkpoint), "--no-eval",
            "--output", str(out), "-q", "--samples", "4", "--seqlen", "32"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert digest == PINNED[name]

"""Streaming (one decoder layer in memory at a time) and resume after an interruption.

The strongest checks are byte equality: a streamed checkpoint is the in-memory one, and an
interrupted-then-resumed run writes the same files as an uninterrupted one.
"""

from __future__ import annotations

import filecmp
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from optc.run import state as layerstore
from optc.run.state import state_dir_for
from optc.model.lazy import meta_model
from optc.run.streaming import checkpoint_reader
from optc.cli.main import app
from optc.errors import Interrupted, OptcError
from optc.evaluate.perplexity import perplexity
from optc.evaluate.streaming import streamed_perplexity
from optc.model.safetensors_io import read_safetensors, write_safetensors
from optc.model.safetensors_io import Lazy, file_slices, write_file, write_sharded
from optc.memory import trim
from optc.run.pipeline import run_recipe
from optc.export.formats import FORMATS
from optc.recipe import parse_recipe
from optc.testing import TINY_ARCHS, tiny_model, tiny_tokens, write_random_model
from test_formats_support import make_tokenizer

runner = CliRunner()
# Files that legitimately differ between two runs: timings (report) and the recipe's own
# streaming switch (recipe.yaml, and the report's copy of it and its byte count).
_VARYING = {"recipe.yaml", "report.json", "report.md", "README.md"}  # README.md: the card holds the recipe


def _same_files(a: Path, b: Path, skip: set[str] = _VARYING) -> None:
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    different = [n for n in names if n not in skip and not filecmp.cmp(a / n, b / n, shallow=False)]
    assert not different, different


def _model_dir(root: Path, tokenizer) -> Path:
    """A 3-layer Llama with untied embeddings (so lm_head is streamed too) and ``tokenizer``."""
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    path = root / "model"
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_tokenizer) -> Path:
    """With the default model's tokenizer."""
    return _model_dir(tmp_path_factory.mktemp("stream"), default_tokenizer)


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory) -> Path:
    """With a 320-token tokenizer: every GGUF file holds its tokenizer, the default one's arrays
    are most of a tiny GGUF export's time."""
    return _model_dir(tmp_path_factory.mktemp("small"), make_tokenizer())


def _recipe(model: Path, method: str = "gptq", streaming: bool | str = False, samples: int = 8):
    return parse_recipe({
        "version": 1, "model": str(model),
        "calibration": {"samples": samples, "seqlen": 64, "batch_size": 2, "streaming": streaming},
        "stages": [{"type": method, "scheme": {"bits": 4, "group_size": 32},
                    **({"iters": 20} if method == "signround" else {})}],
        "evaluation": {"seqlen": 64, "windows": 3},
        "export": {"format": "compressed-tensors", "max_shard_size": "2MB"},  # several shards
    })


@pytest.fixture(autouse=True, scope="module")
def _no_charts():
    with pytest.MonkeyPatch.context() as m:  # PNG rendering is most of a tiny run's time
        m.setattr("optc.evaluate.charts.write_charts", lambda report, directory: [])
        yield


@pytest.fixture(scope="module")
def runs(tiny_dir, tmp_path_factory) -> dict:
    """Uninterrupted runs, in memory and streaming, for each method: {(method, mode): (dir, report)}."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for method in ("gptq", "rtn", "awq", "signround"):
        for mode in ("memory", "stream"):
            path = root / f"{method}-{mode}"
            out[method, mode] = (path, run_recipe(_recipe(tiny_dir, method, mode == "stream"), path))
    return out


# --- the writer ------------------------------------------------------------------------------


def test_stream_writer_writes_the_bytes_of_save_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(5, 3, generator=g), "b": torch.arange(7, dtype=torch.int32),
        "c": torch.tensor([4, 5]), "d": torch.randn(3, generator=g).bfloat16(),
        "e": torch.randn(2, 2, generator=g).half(), "f": torch.arange(5, dtype=torch.int8),
        "g": torch.tensor([True, False]), "h": torch.randn(1, generator=g).double(),
        "empty": torch.zeros(0, 4), "scalar": torch.tensor(3.0),
    }
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    write_file(tmp_path / "mine.safetensors", tensors, {"format": "pt"})
    assert filecmp.cmp(tmp_path / "ref.safetensors", tmp_path / "mine.safetensors", shallow=False)
    # Byte ranges of another file and tensors made on demand give the same file again.
    mixed = {**file_slices(tmp_path / "ref.safetensors"), "z": Lazy(lambda: torch.ones(3), torch.float32, (3,))}
    write_file(tmp_path / "mixed.safetensors", mixed, {"format": "pt"})
    save_file({**tensors, "z": torch.ones(3)}, str(tmp_path / "ref2.safetensors"), metadata={"format": "pt"})
    assert filecmp.cmp(tmp_path / "ref2.safetensors", tmp_path / "mixed.safetensors", shallow=False)
    # Sharded: same plan, names, index and bytes as the in-memory writer.
    write_safetensors(tensors, tmp_path / "a", max_shard_bytes=40)
    write_sharded(dict(tensors), tmp_path / "b", max_shard_bytes=40)
    assert len(os.listdir(tmp_path / "a")) > 2
    _same_files(tmp_path / "a", tmp_path / "b", skip=set())


def test_lazy_entry_must_match_its_declaration(tmp_path):
    with pytest.raises(ValueError, match="declared"):
        write_file(tmp_path / "x.safetensors", {"x": Lazy(lambda: torch.ones(4), torch.float32, (3,))})


# --- layer-major evaluation ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_layer_major_perplexity_equals_the_whole_model(arch, tmp_path):
    tiny_model(arch).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = tiny_tokens(1, 400).flatten()
    ref = perplexity(model, tokens, 64, windows=5, stride=48, batch_size=2)
    got = streamed_perplexity(meta_model(tmp_path, torch.float32), checkpoint_reader(tmp_path), tokens, 64,
                              windows=5, stride=48, batch_size=2)
    assert got.window_nll == ref.window_nll  # same batches, same operations: bit-identical


# --- streaming compression ------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["gptq", "rtn", "awq", "signround"])
def test_streamed_checkpoint_is_the_in_memory_one(runs, method):
    (mem, a), (stream, b) = runs[method, "memory"], runs[method, "stream"]
    assert len(list(mem.glob("model-*.safetensors"))) > 1
    _same_files(mem, stream)
    for key in ("perplexity_baseline", "perplexity_compressed"):
        assert a["metrics"][key]["window_nll"] == b["metrics"][key]["window_nll"]
    for key in ("parameters", "nonzero", "perplexity_change"):
        assert a["metrics"][key] == b["metrics"][key]
    assert a["layers"] == b["layers"]
    assert a["stages"][0]["stats"]["modules"] == b["stages"][0]["stats"]["modules"]
    size_a, size_b = dict(a["metrics"]["size"]), dict(b["metrics"]["size"])
    assert abs(size_a.pop("bytes_on_disk") - size_b.pop("bytes_on_disk")) < 8  # recipe.yaml: "true" vs "auto"
    assert size_a == size_b


def test_streaming_refuses_what_it_cannot_do(tiny_dir):
    two = _recipe(tiny_dir, "gptq", True).model_dump(mode="json")
    two["stages"] = [{"type": "magnitude", "sparsity": 0.5}, two["stages"][0]]
    with pytest.raises(OptcError, match="exactly one"):
        run_recipe(parse_recipe(two), None)
    result = runner.invoke(app, ["run", "sparse-2of4-w4a16", "--model", str(tiny_dir), "--streaming",
                                 "--no-eval", "--no-save", "--samples", "4", "--seqlen", "64"])
    assert result.exit_code == 1
    assert "exactly one" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "compressed-tensors"])
def test_streaming_writes_every_format_as_in_memory(small_vocab_dir, tmp_path, fmt):
    """The streamed run's sink is the format's own writer, fed from disk: same bytes as in memory."""
    data = _recipe(small_vocab_dir, "rtn").model_dump(mode="json")
    data["evaluation"] = None
    data["export"]["format"] = fmt
    for mode in ("memory", "stream"):
        data["calibration"]["streaming"] = mode == "stream"
        run_recipe(parse_recipe(data), tmp_path / mode)
    if fmt != "dense":
        _same_files(tmp_path / "memory", tmp_path / "stream")
        return
    # dense in memory is transformers' save_pretrained, whose shard plan is its own: same tensors.
    mem, stream = read_safetensors(tmp_path / "memory"), read_safetensors(tmp_path / "stream")
    assert sorted(mem) == sorted(stream)
    assert all(torch.equal(mem[k], stream[k]) and mem[k].dtype == stream[k].dtype for k in mem)


def test_auto_streaming_only_when_the_model_does_not_fit(tiny_dir, monkeypatch):
    from optc.run.streaming import wants_streaming

    assert not wants_streaming(_recipe(tiny_dir, streaming="auto"))

    class Tiny:
        available = 1000

    monkeypatch.setattr("psutil.virtual_memory", lambda: Tiny())
    assert wants_streaming(_recipe(tiny_dir, streaming="auto"))


def test_eval_streaming_matches_eval_in_memory(runs, tiny_dir):
    ckpt = runs["gptq", "stream"][0]
    args = ["eval", str(ckpt), "--baseline", str(tiny_dir), "--seqlen", "64", "--windows", "3", "--json", "--quiet"]
    plain = json.loads(runner.invoke(app, args).output)
    result = runner.invoke(app, [*args, "--streaming"])
    assert result.exit_code == 0, result.output
    streamed = json.loads(result.output)
    for key in ("perplexity_baseline", "perplexity_compressed"):
        assert streamed["metrics"][key]["window_nll"] == plain["metrics"][key]["window_nll"]
    assert streamed["metrics"]["perplexity_change"] == plain["metrics"]["perplexity_change"]
    for key in ("parameters", "nonzero", "bytes_on_disk"):
        assert streamed["metrics"][key] == plain["metrics"][key]
    assert [r["scheme"] for r in streamed["layers"]] == [r["scheme"] for r in plain["layers"]]


def _peak_rss_since_reset() -> int | None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets the VmHWM high-water mark
        return next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmHWM"))
    except OSError:
        return None


@pytest.mark.slow  # writes and streams a 0.6 GB model
def test_streaming_memory_stays_far_below_the_model(tmp_path, default_tokenizer):
    """A 24-layer random model: the streamed run's peak resident memory grows by much less than
    the model's size (it holds one layer, not all of them)."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=640, intermediate_size=2560, num_hidden_layers=24,
                      num_attention_heads=10, num_key_value_heads=2, max_position_embeddings=256)
    write_random_model(tmp_path / "model", cfg, default_tokenizer, max_shard_bytes=100 << 20)
    model_bytes = sum(f.stat().st_size for f in (tmp_path / "model").glob("*.safetensors"))
    recipe = parse_recipe({"version": 1, "model": str(tmp_path / "model"), "calibration": {"streaming": True},
                           "stages": [{"type": "rtn"}], "evaluation": None,
                           "export": {"format": "compressed-tensors"}})
    trim()
    before = _peak_rss_since_reset()
    if before is None:
        pytest.skip("cannot reset the peak-RSS counter on this system")
    run_recipe(recipe, tmp_path / "out")
    peak = int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmHWM"))) * 1024
    grown = peak - before
    assert model_bytes > 500 << 20
    assert grown < 0.5 * model_bytes, f"peak RSS grew {grown >> 20} MiB for a {model_bytes >> 20} MiB model"
    assert checkpoint_reader(tmp_path / "out").qc["format"] == "pack-quantized"


# --- resume -------------------------------------------------------------------------------------------


def _interrupt_after(monkeypatch, layer: int, exc: type[BaseException] = KeyboardInterrupt) -> None:
    done = layerstore.LayerStore.done

    def boom(self, i, *args, **kwargs):
        done(self, i, *args, **kwargs)
        if i == layer:
            raise exc

    monkeypatch.setattr(layerstore.LayerStore, "done", boom)


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_resume_after_ctrl_c_gives_the_same_checkpoint(runs, tiny_dir, tmp_path, monkeypatch, mode):
    out = tmp_path / "cut"
    recipe = _recipe(tiny_dir, "gptq", mode == "stream")
    with monkeypatch.context() as m:
        _interrupt_after(m, 1)
        with pytest.raises(Interrupted) as info:
            run_recipe(recipe, out)
    assert "2 layers done" in info.value.where
    assert not out.exists() and not list(tmp_path.glob(".cut.partial-*"))  # no partial output
    assert (state_dir_for(out) / "progress.json").is_file()
    with pytest.raises(OptcError, match="--resume"):  # the saved layers are never dropped silently
        run_recipe(recipe, out)
    with pytest.raises(OptcError, match="calibration.samples"):
        run_recipe(_recipe(tiny_dir, "gptq", mode == "stream", samples=6), out, resume=True)
    resumed = run_recipe(recipe, out, resume=True)
    full, report = runs["gptq", mode]
    _same_files(full, out, skip={"report.json", "report.md"})
    assert not state_dir_for(out).exists()  # a finished run leaves no state behind
    assert resumed["metrics"]["perplexity_compressed"]["window_nll"] == report["metrics"]["perplexity_compressed"]["window_nll"]
    assert resumed["stages"][0]["stats"]["modules"] == report["stages"][0]["stats"]["modules"]


@pytest.mark.slow  # a second Python process (imports dominate); the Ctrl-C test covers the same state in-process
def test_sigkill_then_resume_gives_the_same_checkpoint(runs, tiny_dir, tmp_path):
    """The process dies with no chance to clean up (SIGKILL after layer 1); --resume finishes it."""
    out = tmp_path / "killed"
    script = (
        "import json, os, signal, sys\n"
        "from pathlib import Path\n"
        "from optc.run import state as layerstore\n"
        "from optc.run.pipeline import run_recipe\n"
        "from optc.recipe import parse_recipe\n"
        "done = layerstore.LayerStore.done\n"
        "def kill(self, i, *a, **k):\n"
        "    done(self, i, *a, **k)\n"
        "    if i == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
        "layerstore.LayerStore.done = kill\n"
        "run_recipe(parse_recipe(json.loads(Path(sys.argv[2]).read_text())), Path(sys.argv[1]))\n"
    )
    (tmp_path / "recipe.json").write_text(json.dumps(_recipe(tiny_dir, "gptq", True).model_dump(mode="json")))
    proc = subprocess.run([sys.executable, "-c", script, str(out), str(tmp_path / "recipe.json")], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not out.exists()
    run_recipe(_recipe(tiny_dir, "gptq", True), out, resume=True)
    _same_files(runs["gptq", "stream"][0], out, skip={"report.json", "report.md"})


def test_cli_ctrl_c_says_how_to_resume(tiny_dir, tmp_path, monkeypatch):
    out = tmp_path / "cli"
    args = ["quantize", "--recipe", "w4a16-gptq", "--model", str(tiny_dir), "--samples", "4", "--seqlen", "64",
            "--no-eval", "--output", str(out)]
    with monkeypatch.context() as m:
        _interrupt_after(m, 0)
        result = runner.invoke(app, args)
    assert result.exit_code == 130
    assert "--resume" in result.output and str(state_dir_for(out)) in result.output.replace("\n", "")
    assert not out.exists()
    result = runner.invoke(app, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    assert (out / "config.json").is_file() and not state_dir_for(out).exists()


def test_a_user_error_mid_run_leaves_no_state(tiny_dir, tmp_path, monkeypatch):
    out = tmp_path / "bad"
    with monkeypatch.context() as m:
        _interrupt_after(m, 1, OptcError)
        with pytest.raises(OptcError):
            run_recipe(_recipe(tiny_dir), out)
    assert not out.exists() and not state_dir_for(out).exists()


def test_saved_activations_are_the_bytes_before_the_next_layer_overwrites_them(tmp_path):
    # The commit (fsync, rename, progress) runs in the background while the next layer reuses
    # the activation buffers in place: the file must hold what they were when the layer ended.
    from types import SimpleNamespace

    store = layerstore.LayerStore(tmp_path / "state", {"run": 1}, {})
    store.begin_stage(0, "gptq")
    batches = [SimpleNamespace(hidden=torch.randn(2, 3, 4)) for _ in range(3)]
    before = [b.hidden.clone() for b in batches]
    layer = torch.nn.Linear(4, 4)
    store.done(0, "model.layers.0", layer, {"loss": 1.0}, batches, {}, last=False)
    for b in batches:
        b.hidden.fill_(7.0)
    store.flush()
    saved = load_file(str(tmp_path / "state" / "acts-00000.safetensors"))
    assert all(torch.equal(saved[str(j)], before[j]) for j in range(3))
    assert not list((tmp_path / "state").glob(".*.tmp"))
    progress = json.loads((tmp_path / "state" / "progress.json").read_text())
    assert [r["layer"] for r in progress["layers"]] == ["model.layers.0"]
    store.done(1, "model.layers.1", layer, {"loss": 1.0}, batches, {}, last=False)
    store.flush()  # layer 1's progress is on disk, so layer 0's activations are gone
    assert sorted(p.name for p in (tmp_path / "state").glob("acts-*")) == ["acts-00001.safetensors"]
    store.remove()
    assert not (tmp_path / "state").exists()


def test_in_memory_layers_are_saved_at_most_once_per_interval(tmp_path, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setenv("OPTC_RESUME_INTERVAL", "3600")
    store = layerstore.LayerStore(tmp_path / "state", {"run": 1}, {})
    store.begin_stage(0, "gptq")
    batches = [SimpleNamespace(hidden=torch.randn(2, 3, 4))]
    layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    for i in range(2):
        store.done(i, f"model.layers.{i}", layers[i], {"loss": 1.0}, batches, {}, last=False)
    store.flush()
    assert not store.has_progress() and store.describe() == "no layer saved yet"
    assert not list((tmp_path / "state").glob("*.safetensors"))  # nothing written inside the interval
    store.done(2, "model.layers.2", layers[2], {"loss": 1.0}, batches, {}, last=True)
    store.flush()  # the last layer is always saved, with every layer finished before it
    progress = json.loads((tmp_path / "state" / "progress.json").read_text())
    assert [r["layer"] for r in progress["layers"]] == [f"model.layers.{i}" for i in range(3)]
    assert sorted(p.name for p in (tmp_path / "state").glob("layer-*")) == [f"layer-0000{i}.safetensors" for i in range(3)]
    for i in range(3):
        saved = load_file(str(tmp_path / "state" / f"layer-0000{i}.safetensors"))
        assert torch.equal(saved["weight"], layers[i].weight.detach())
    assert store.describe() == "stage 0 (gptq): 3 layers done"
    monkeypatch.setenv("OPTC_RESUME_INTERVAL", "soon")
    with pytest.raises(OptcError, match="OPTC_RESUME_INTERVAL"):
        layerstore.LayerStore(tmp_path / "other", {"run": 1}, {})
    store.remove()

from __future__ import annotations

import pytest
import torch
from torch import nn

from optc.model.anatomy import find_decoder_layers, is_linear, select_linears
from optc.calibrate.sequential import _onednn_linear, run_sequential
from optc.errors import OptcError
from optc.testing import TINY_ARCHS, tiny_model, tiny_tokens


def _layer_outputs(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each decoder layer's output in a plain forward of the whole model."""
    _, layers = find_decoder_layers(model)
    outs: list[torch.Tensor] = []
    handles = [
        layer.register_forward_hook(lambda _m, _a, out: outs.append(out[0] if isinstance(out, tuple) else out))
        for layer in layers
    ]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return outs


def _no_hooks(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_noop_solver_reproduces_the_plain_forward(arch: str) -> None:
    model = tiny_model(arch)
    ids = tiny_tokens(n=5, seqlen=24)
    expected = _layer_outputs(model, ids)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prefix, layers = find_decoder_layers(model)
    seen: list[tuple[int, str, list[str]]] = []
    got: list[torch.Tensor] = []

    def solve(step):
        seen.append((step.index, step.name, sorted(step.linears)))
        got.append(torch.cat(step.run()))  # the layer's outputs on the captured inputs
        return {"n": len(step.linears)}

    # batch_size 2 over 5 samples: the last batch is smaller, as in real runs.
    stats = run_sequential(model, ids, solve, targets=[".*"], ignore=["lm_head"], batch_size=2)

    all_linears = {n for n, m in model.named_modules() if is_linear(m) and n.startswith(prefix + ".")}
    assert [s[:2] for s in seen] == [(i, f"{prefix}.{i}") for i in range(len(layers))]
    assert sorted(n for s in seen for n in s[2]) == sorted(all_linears)
    for i, (_, name, names) in enumerate(seen):
        assert names and all(n.startswith(name + ".") for n in names)
        assert dict(layers[i].named_modules()).keys() >= {n.removeprefix(name + ".") for n in names}
    assert [s["layer"] for s in stats] == [s[1] for s in seen] and all(s["n"] for s in stats)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert _no_hooks(model) and not model.training


@pytest.mark.parametrize("backend", ["mkl", "onednn"])
def test_cpu_linear_backends_reproduce_the_plain_forward(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """OPTC_CPU_LINEAR picks MKL or oneDNN for the calibration forwards; both give the layer
    outputs of a plain forward, and oneDNN is really the one called when chosen."""
    monkeypatch.setenv("OPTC_CPU_LINEAR", backend)
    _onednn_linear.cache_clear()
    try:
        model = tiny_model("llama")
        ids = tiny_tokens(n=3, seqlen=16)
        expected = _layer_outputs(model, ids)
        got: list[torch.Tensor] = []

        def solve(step):
            got.append(torch.cat(step.run()))
            return {}

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run_sequential(model, ids, solve, targets=[".*"], ignore=["lm_head"], batch_size=2)
        used = any(e.name == "mkldnn::_linear_pointwise" for e in prof.events())
        assert used == (backend == "onednn" and torch.backends.mkldnn.is_available())
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
        monkeypatch.setenv("OPTC_CPU_LINEAR", "blas")
        _onednn_linear.cache_clear()
        with pytest.raises(OptcError, match="OPTC_CPU_LINEAR"):
            run_sequential(model, ids, solve, targets=[".*"], ignore=["lm_head"], batch_size=2)
    finally:
        _onednn_linear.cache_clear()


def test_targets_select_a_subset() -> None:
    model = tiny_model("llama")
    seen: list[str] = []
    run_sequential(
        model, tiny_tokens(n=2, seqlen=16), lambda step: seen.extend(step.linears) or {},
        targets=["mlp"], ignore=["down_proj"], batch_size=2,
    )
    assert sorted(seen) == sorted(
        f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj")
    )


def test_solver_changes_propagate_to_later_layers() -> None:
    model = tiny_model("llama")
    ids = tiny_tokens(n=2, seqlen=16)
    inputs: list[torch.Tensor] = []

    def solve(step):
        if step.index == 0:  # "compress" layer 0
            with torch.no_grad():
                step.linears["model.layers.0.mlp.down_proj"].weight.zero_()
        else:
            step.collect(["model.layers.1.self_attn.q_proj"], lambda n, m: _Keep(inputs))
        return {}

    run_sequential(model, ids, solve, targets=[".*"], ignore=[], batch_size=2)
    # Layer 1 saw the inputs produced by the already-modified layer 0.
    seen_q: list[torch.Tensor] = []
    h = model.model.layers[1].self_attn.q_proj.register_forward_hook(lambda m, a, o: seen_q.append(a[0]))
    with torch.no_grad():
        model(ids, use_cache=False)
    h.remove()
    torch.testing.assert_close(torch.cat(inputs), seen_q[0], atol=1e-5, rtol=1e-5)


class _Keep:
    def __init__(self, store: list) -> None:
        self.store = store

    def add(self, x: torch.Tensor) -> None:
        self.store.append(x)


class _Boom:
    def add(self, x: torch.Tensor) -> None:
        raise RuntimeError("boom in accumulator")


@pytest.mark.parametrize("where", ["accumulator", "solver"])
def test_hooks_removed_after_solver_error(where: str) -> None:
    model = tiny_model("llama")
    ids = tiny_tokens(n=2, seqlen=16)

    def solve(step):
        if where == "accumulator":
            step.collect(list(step.linears), lambda n, m: _Boom())
        step.collect(list(step.linears), lambda n, m: _Keep([]))
        raise RuntimeError("boom in solver")

    with pytest.raises(RuntimeError, match="boom"):
        run_sequential(model, ids, solve, targets=[".*"], ignore=[], batch_size=2)
    linears = [m for m in model.modules() if is_linear(m)]
    assert linears and all(not m._forward_hooks for m in linears)
    assert _no_hooks(model)
    _, layers = find_decoder_layers(model)
    assert len(layers) == 2  # the decoder stack is back in the model
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_select_linears_no_match_lists_existing() -> None:
    model = tiny_model("llama")
    with pytest.raises(OptcError, match=r"match no Linear.*model\.layers\.0\.mlp\.down_proj"):
        select_linears(model, ["nonexistent_proj"], [])
    with pytest.raises(OptcError, match="match no Linear"):
        select_linears(model, [".*"], [".*"])
    gpt2 = select_linears(tiny_model("gpt2"), ["c_attn"], [])
    assert sorted(gpt2) == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]
    assert "lm_head" not in select_linears(model, [".*"], [])  # only Linears inside decoder layers


@pytest.mark.parametrize("arch", ["llama", "opt", "gpt2"])
def test_collect_shares_inputs_and_sees_every_batch(arch: str) -> None:
    """Linears reading one tensor share an accumulator, and stopping each later batch after
    the last hooked Linear still feeds every Linear every batch, unchanged."""
    model = tiny_model(arch)
    ids = tiny_tokens(n=6, seqlen=16)
    expected: dict[str, list[torch.Tensor]] = {}
    handles = [
        m.register_forward_pre_hook(lambda mod, a, _n=n: expected.setdefault(_n, []).append(a[0].clone()))
        for n, m in select_linears(model, [r"\.0\."], ["lm_head"]).items()
    ]
    with torch.no_grad():
        for start in range(0, 6, 2):  # the engine's batches, through the float model
            model(ids[start : start + 2], use_cache=False)
    for h in handles:
        h.remove()
    got: dict[str, _Keep] = {}

    def solve(step):
        if step.index == 0:
            got.update(step.collect(list(step.linears), lambda n, m: _Keep([])))
        return {}

    run_sequential(model, ids, solve, targets=[r"\.0\."], ignore=["lm_head"], batch_size=2)
    assert set(got) == set(expected)
    groups = {id(acc) for acc in got.values()}
    if arch == "llama":  # q/k/v read one tensor, gate/up another: 4 inputs for 7 Linears
        assert len(groups) == 4
    for name, acc in got.items():
        shared = sum(a is acc for a in got.values())
        # An accumulator shared by k Linears receives its input once per batch, not k times.
        assert len(acc.store) == len(expected[name]) == 3, (name, shared)
        for x, e in zip(acc.store, expected[name]):
            torch.testing.assert_close(x, e)


@pytest.mark.parametrize("arch", ["llama", "opt", "gpt2"])
def test_input_groups_follow_the_layer_calls(arch: str) -> None:
    """input_groups (one batch) finds the same groups, in the same order, as a full collect."""
    model = tiny_model(arch)
    ids = tiny_tokens(n=6, seqlen=16)
    found: dict[str, object] = {}

    def solve(step):
        if step.index == 0:
            names = list(step.linears)
            order: list[str] = []

            def make(n, m):
                order.append(n)
                return _Keep([])

            accs = step.collect(names, make)
            expected = [[n for n in names if accs[n] is accs[o]] for o in order]
            found["groups"], found["expected"] = step.input_groups(names), expected
            found["forwards"] = step.forwards
        return {}

    run_sequential(model, ids, solve, targets=[r"\.0\."], ignore=["lm_head"], batch_size=2)
    assert found["groups"] == found["expected"]
    assert found["forwards"] == 1  # a single batch is not a layer forward
    if arch == "llama":
        assert [len(g) for g in found["groups"]] == [3, 1, 2, 1]


@pytest.mark.parametrize("samples, batches", [(None, 3), (1, 1), (2, 1), (3, 2), (99, 3)])
def test_collect_takes_the_first_batches_holding_the_samples(samples, batches) -> None:
    model = tiny_model("llama")
    ids = tiny_tokens(n=6, seqlen=8)
    seen: list[torch.Tensor] = []

    def solve(step):
        if step.index == 0:
            step.collect(["model.layers.0.self_attn.q_proj"], lambda n, m: _Keep(seen), samples=samples)
        return {}

    run_sequential(model, ids, solve, targets=[".*"], ignore=[], batch_size=2)
    assert len(seen) == batches and all(x.shape[0] == 2 for x in seen)


@pytest.mark.parametrize("samples", [None, 3])
def test_collect_on_a_stream_advances_it_as_advance_other(samples) -> None:
    """``collect(stream=...)`` feeds the accumulators the Linears' inputs on another stream
    (its first batches holding ``samples``) and leaves in the stream what advance_other would:
    one forward for both."""
    model = tiny_model("llama")
    ids = tiny_tokens(n=6, seqlen=8)
    found: dict[str, object] = {}

    def solve(step):
        if step.index != 1:
            return {}
        names = list(step.linears)
        stream = [b.hidden * 1.5 for b in step.batches]  # another model's activations, say
        other = [s.clone() for s in stream]
        forwards = step.forwards
        got = step.collect(names, lambda n, m: _Keep([]), samples=samples, stream=stream)
        found["forwards"] = step.forwards - forwards
        step.advance_other(other)
        found["advanced"] = all(torch.equal(s, o) for s, o in zip(stream, other))
        own = [b.hidden for b in step.batches]
        for b in step.batches:
            b.hidden = b.hidden * 1.5
        ref = step.collect(names, lambda n, m: _Keep([]), samples=samples)
        for b, h in zip(step.batches, own):
            b.hidden = h
        found["groups"] = len({id(a) for a in got.values()}), len({id(a) for a in ref.values()})
        found["inputs"] = [(len(got[n].store), len(ref[n].store)) for n in names]
        found["equal"] = all(torch.equal(x, y) for n in names for x, y in zip(got[n].store, ref[n].store))
        return {}

    run_sequential(model, ids, solve, targets=[".*"], ignore=[], batch_size=2)
    assert found["forwards"] == 1 and found["advanced"] and found["equal"]
    assert found["groups"] == (4, 4)
    assert all(n == r == (3 if samples is None else 2) for n, r in found["inputs"]), found["inputs"]

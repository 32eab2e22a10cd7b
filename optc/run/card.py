"""The model card (``README.md``) of a checkpoint: Hugging Face front matter and what was done.

Built from the checkpoint's ``report.json`` and ``recipe.yaml`` alone, so ``optc report --card``
regenerates it from a finished checkpoint. The front matter (``base_model``, ``library_name``,
``pipeline_tag``, ``tags``, ``license`` when the source's is known) is what the hub's model-card
parser reads; the body says what the recipe did, how well the result scored, how to load it (the
format's own snippet, from the format registry) and which data calibrated it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import yaml

from optc.errors import OptcError
from optc.export.formats import FORMATS, detect_format
from optc.methods import METHODS
from optc.model.load import model_origin

log = logging.getLogger(__name__)

CARD = "README.md"
CHECKPOINT = "path/to/checkpoint"


def _what(stats: dict) -> str:
    """What a stage did to the Linears, from its per-Linear statistics (the stage summary in the
    report also carries timings)."""
    modules = stats.get("modules") or {}
    if not modules:
        return "applied"
    parts = [f"{len(modules)} Linears"]
    schemes = sorted({m["scheme"] for m in modules.values() if "scheme" in m})
    if schemes:
        parts.append(", ".join(schemes))
    sparsity = [m["sparsity"] for m in modules.values() if "sparsity" in m]
    if sparsity:
        parts.append(f"mean sparsity {sum(sparsity) / len(sparsity):.3f}")
    return "; ".join(parts)


def _front_matter(report: dict, recipe: dict, fmt_name: str | None) -> dict:
    origin, license_ = model_origin(report.get("model"))
    stages = recipe.get("stages") or []
    kinds = [METHODS[s["type"]].kind for s in stages if s.get("type") in METHODS]
    tags = ["optc"]
    tags += [s["type"] for s in stages if s.get("type")]
    tags += sorted({f"{s['scheme']['bits']}-bit" for s in stages if isinstance(s.get("scheme"), dict)
                    and s["scheme"].get("bits")})
    tags += ["quantized"] * ("quantize" in kinds) + ["pruned"] * ("prune" in kinds)
    if fmt_name:
        tags.append(fmt_name)
    data: dict[str, Any] = {}
    if origin:
        data["base_model"] = origin
    # A GGUF file is loaded by llama.cpp and its kin; everything else optc writes by transformers.
    data["library_name"] = "gguf" if fmt_name and fmt_name.startswith("gguf") else "transformers"
    data["pipeline_tag"] = "text-generation"
    data["tags"] = list(dict.fromkeys(tags))
    if license_:
        data["license"] = license_
    return data


def _ppl(r: dict) -> str:
    lo, hi = r.get("ci95") or (None, None)
    ci = f" (95% CI [{lo:.3f}, {hi:.3f}])" if lo is not None and hi is not None else ""
    return f"{r['perplexity']:.3f}{ci}"


def accuracy_table(report: dict) -> list[str]:
    """The report's numbers as one Markdown table (perplexity with intervals, change, KL, size,
    bits per weight, stored dtype, latency when measured)."""
    m = report.get("metrics") or {}
    rows: list[tuple[str, str]] = []
    for key, label in (("perplexity_baseline", "perplexity, uncompressed"), ("perplexity_compressed", "perplexity, this checkpoint"),
                       ("perplexity_model", "perplexity")):
        if isinstance(m.get(key), dict):
            rows.append((label, _ppl(m[key])))
    ch = m.get("perplexity_change")
    if ch:
        lo, hi = ch["ppl_increase_pct_ci95"]
        ci = f" (paired 95% CI [{lo:+.2f}%, {hi:+.2f}%])" if lo is not None else ""
        rows.append(("perplexity change", f"{ch['ppl_increase_pct']:+.2f}%{ci}"))
    dv = m.get("divergence")
    if dv:
        rows.append(("KL divergence (mean / p99)", f"{dv['kl_mean']:.4f} / {dv['kl_p99']:.4f} nats"))
        rows.append(("top-1 agreement", f"{100 * dv['top1_agreement']:.2f}%"))
    sz = m.get("size") or {}
    if sz.get("bytes_on_disk") is not None:
        rows.append(("size on disk", f"{sz['bytes_on_disk'] / 2**20:.1f} MiB"))
    if sz.get("compression_ratio") is not None:
        rows.append(("compression vs float16", f"{sz['compression_ratio']:.2f}x"))
    if sz.get("bits_per_weight") is not None:
        extra = f" ({sz['linear_bits_per_weight']:.2f} in decoder Linears)" if sz.get("linear_bits_per_weight") else ""
        rows.append(("bits per weight", f"{sz['bits_per_weight']:.2f}{extra}"))
    if sz.get("dtype"):
        rows.append(("unquantized tensors stored in", sz["dtype"]))
    for who, run in ((w, (m.get("latency") or {}).get(w)) for w in ("model", "baseline")):
        if run:
            rows.append((f"decode latency ({who}, batch 1)", f"{run['decode_tokens_per_s']:.1f} tokens/s ({run['kernel']})"))
    note = [] if any(label.startswith("perplexity") for label, _ in rows) else [
        "No perplexity evaluation was run (`--no-eval`).", ""]
    return note + (["| metric | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)] if rows else [])


def _protocol(recipe: dict, report: dict) -> str:
    ev = recipe.get("evaluation") or {}
    first = next((v for k, v in (report.get("metrics") or {}).items()
                  if k.startswith("perplexity_") and isinstance(v, dict) and "windows" in v), None)
    if not ev or first is None:
        return ""
    return (f"Perplexity on {first['windows']} windows of {first['seqlen']} tokens of `{ev.get('dataset', 'builtin')}` "
            "(held out from calibration); intervals are 95% t-intervals over the per-window losses.")


def _source_words(src: dict) -> str:
    words = f"`{src.get('dataset', 'builtin')}`"
    extra = [f"{k} `{src[k]}`" for k in ("config", "split", "text_column") if src.get(k)]
    if src.get("rendering") == "chat" or (src.get("rendering") == "auto" and src.get("text_column") == "messages"):
        extra.append("rendered with the model's chat template")
    return words + (f" ({', '.join(extra)})" if extra else "")


def calibration_words(recipe: dict) -> str:
    stages = recipe.get("stages") or []
    # Methods that collect statistics (and recovery, which trains) read calibration text.
    users = [s["type"] for s in stages if s.get("type") in METHODS
             and (METHODS[s["type"]].accumulators or METHODS[s["type"]].kind == "recover")]
    if not users:
        return f"None: {', '.join(s.get('type', '?') for s in stages) or 'no stage'} needs no calibration data."
    cal = recipe.get("calibration") or {}
    if cal.get("mix"):
        total = sum(s.get("weight", 1.0) for s in cal["mix"])
        source = "a mix of " + ", ".join(f"{_source_words(s)} ({100 * s.get('weight', 1.0) / total:.0f}%)" for s in cal["mix"])
    else:
        source = _source_words(cal)
    return (f"{cal.get('samples')} samples of {cal.get('seqlen')} tokens from {source}, "
            f"{cal.get('sampling', 'first')} chunks, seed {cal.get('seed', 0)}; used by {', '.join(users)}.")


def render_card(report: dict, recipe_yaml: str, directory: Path) -> str:
    recipe = yaml.safe_load(recipe_yaml) or {}
    fmt_name = (recipe.get("export") or {}).get("format")
    fmt = FORMATS.get(fmt_name) if fmt_name else detect_format(directory)
    fmt_name = fmt.name if fmt is not None else fmt_name
    front = _front_matter(report, recipe, fmt_name)
    base = front.get("base_model") or report.get("model")
    name = recipe.get("name", "custom")
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
             f"# {Path(str(base)).name} · {name}", "",
             f"`{base}` compressed by optc with the recipe `{name}`"
             + (f": {recipe['description']}" if recipe.get("description") else "") + ".", "",
             "## What was done", ""]
    for i, st in enumerate(report.get("stages") or []):
        # No timings or dates here: the card is part of the checkpoint, which is the same bytes
        # for the same inputs (report.json keeps when and how long).
        lines.append(f"{i + 1}. `{st['type']}`: {_what(st.get('stats') or {})}")
    if not report.get("stages"):
        lines.append("No compression stage: the checkpoint holds the model as loaded.")
    ck = report.get("checkpoint") or {}
    lines += ["", f"Stored as `{ck.get('format', fmt_name)}`.", "",
              "The recipe as applied:", "", "```yaml", recipe_yaml.rstrip(), "```", "",
              "## Accuracy", "", *accuracy_table(report), ""]
    protocol = _protocol(recipe, report)
    if protocol:
        lines += [protocol, ""]
    # A placeholder, not the output path: the card travels with the checkpoint (to a hub, to
    # another machine), and two runs of the same recipe write the same bytes wherever they write.
    lines += ["## How to load it", "", f"`{CHECKPOINT}`: this directory, or its hub id once uploaded.", ""]
    usage = fmt.usage if fmt is not None and fmt.usage else "See the optc README for this format."
    weights = sorted(p.name for p in Path(directory).glob("*.gguf"))
    lines += [usage.format(path=CHECKPOINT, file=weights[0] if weights else "model.gguf").rstrip(), ""]
    lines += ["## Calibration data", "", calibration_words(recipe), ""]
    env = report.get("environment") or {}
    lines.append(f"Made with optc {env.get('optc')}, torch {env.get('torch')}, transformers {env.get('transformers')}; "
                 "the full numbers are in `report.json` / `report.md`.")
    return "\n".join(lines) + "\n"


def write_model_card(directory: Path, report: dict | None = None) -> Path:
    """``README.md`` of the checkpoint in ``directory`` from its report and recipe."""
    directory = Path(directory).expanduser()
    if report is None:
        path = directory / "report.json"
        if not path.is_file():
            raise OptcError(f"{directory} has no report.json: a model card is made from an optc checkpoint's report")
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise OptcError(f"cannot read {path}: {exc}") from None
    recipe_file = directory / "recipe.yaml"
    recipe_yaml = (recipe_file.read_text(encoding="utf-8") if recipe_file.is_file()
                   else yaml.safe_dump(report.get("recipe") or {}, sort_keys=False))
    target = directory / CARD
    target.write_text(render_card(report, recipe_yaml, directory), encoding="utf-8")
    return target

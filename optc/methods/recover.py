"""Recovery: LoRA fine-tuning of the compressed model with distillation from the float one.

The training loop, adapters and their resumable state are :mod:`optc.methods.recover_training`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from optc.methods.base import LinearsConfig
from optc.methods.registry import Method, register

if TYPE_CHECKING:
    from optc.methods.workspace import Workspace


class RecoverStage(LinearsConfig):
    """LoRA fine-tuning of the compressed model (Hu et al. 2021) with next-token
    cross-entropy, distillation from the uncompressed model (Hinton et al. 2015), or a mix;
    pruning masks and quantization grids are kept (see optc.methods.recover_training)."""

    type: Literal["recover"]
    steps: int | None = Field(None, gt=0, description="optimizer steps (deterministic budget)")
    tokens: int | None = Field(None, gt=0, description="training tokens (steps = tokens / (batch_size * seqlen))")
    max_minutes: float | None = Field(None, gt=0, description="wall-clock budget; the schedule follows the clock")
    lr: float = Field(1e-3, gt=0, description="peak learning rate (AdamW)")
    warmup: float = Field(0.05, ge=0, lt=1, description="fraction of the run with a linear warm-up")
    rank: int = Field(16, gt=0, description="LoRA rank r")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha (the update is scaled by alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout (unmasked float-grid adapters only)")
    loss: Literal["ce", "kd", "mix"] = Field("mix", description="cross-entropy, distillation KL, or a mix")
    kd_weight: float = Field(0.5, ge=0, le=1, description="mix: weight of the distillation term")
    temperature: float = Field(1.0, gt=0, description="distillation temperature T")
    teacher: str | None = Field(
        None, description="model to distil from; null: the recipe's model as loaded, before any stage"
    )
    teacher_cache: Literal["none", "topk"] = Field(
        "none", description="none: teacher logits on the fly; topk: its top-k logits cached on disk"
    )
    teacher_topk: int = Field(128, gt=0, description="logits kept per token by teacher_cache: topk")
    batch_size: int = Field(4, gt=0, description="sequences per step")
    seqlen: int | None = Field(None, gt=1, description="tokens per sequence (null: calibration.seqlen)")
    samples: int | None = Field(None, gt=0, description="training sequences (null: every chunk of the calibration text)")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass (less memory, ~30% slower)")
    max_grad_norm: float = Field(1.0, ge=0, description="gradient clipping (0: off)")
    save_every: int = Field(25, ge=0, description="save resumable state every N steps (0: never)")
    state_dir: str | None = Field(None, description="resumable state (default: beside the output)")
    resume: bool = Field(False, description="continue from the state saved by an interrupted run")
    seed: int = 0
    export: Literal["merge", "adapter"] = Field(
        "merge", description="merge: fold the update into the weights (re-quantized onto the same "
        "grid); adapter: keep it separate as a peft adapter beside the checkpoint",
    )
    eval_before: bool = Field(True, description="evaluate the model just before recovery too")

    @model_validator(mode="after")
    def _has_budget(self):
        if self.steps is None and self.tokens is None and self.max_minutes is None:
            raise ValueError("recovery needs a budget: steps, tokens and/or max_minutes")
        return self


def run_recover(ws: Workspace, cfg: RecoverStage) -> dict:
    import torch

    from optc.data import calibration_chunks
    from optc.errors import OptcError
    from optc.methods.recover_training import (
        Adapter,
        attach_adapters,
        check_recoverable,
        check_resumable,
        float_latents,
        merge_adapters,
        pattern_violations,
        total_steps,
        train_adapters,
    )
    from optc.model.anatomy import weight_2d

    linears = check_recoverable(ws.model, cfg)
    if cfg.export == "adapter" and any(n in ws.masks for n in linears):
        raise OptcError(
            "export: adapter cannot keep the pruning masks (peft adds B A densely, so the pruned "
            "weights would move); use export: merge for a pruned model"
        )
    teacher = None
    if cfg.loss != "ce":
        if ws.teacher is None:
            raise OptcError("distillation (loss kd or mix) needs the uncompressed model as teacher")
        teacher = ws.teacher
    state_dir = Path(cfg.state_dir).expanduser() if cfg.state_dir else ws.state_dir
    if cfg.resume:
        check_resumable(state_dir)  # before any tokenizing, evaluating or training
    seqlen = cfg.seqlen or ws.calibration.seqlen
    chunks = calibration_chunks(ws.tokenizer, ws.calibration, seqlen, cfg.samples)[: cfg.samples]
    before = ws.evaluate(ws.model) if (cfg.eval_before and ws.evaluate is not None) else None
    latents = float_latents(ws.teacher, linears, ws.qparams) if cfg.export == "merge" else {}
    wrappers = attach_adapters(ws.model, linears, cfg, ws.masks, ws.qparams, latents)
    try:
        run = train_adapters(ws.model, wrappers, teacher, chunks, cfg, state_dir, ws.progress)
    finally:
        tensors = {n: (w.lora_A.detach().clone(), w.lora_B.detach().clone()) for n, w in wrappers.items()}
        per_module, base = merge_adapters(ws.model, wrappers, keep_base=cfg.export == "adapter")
    zeros_moved = sum(int((weight_2d(linears[n]).detach()[~m] != 0).sum()) for n, m in ws.masks.items() if n in linears)
    quantized = [n for n in linears if n in ws.qparams]
    if cfg.export == "adapter":
        ws.adapter = Adapter(
            tensors=tensors, rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout,
            base_model=str(ws.model.config._name_or_path or ""),
            conv1d=any(not isinstance(m, torch.nn.Linear) for m in linears.values()), base_weights=base,
        )
        exported = "adapter kept separate: adapter_model.safetensors + adapter_config.json (peft LoRA) beside the checkpoint, whose weights are the pre-recovery ones"
    elif quantized:
        exported = (f"merged and re-quantized onto the same grid ({len(quantized)} quantized Linears, "
                    f"{len(latents)} from their float weights; trained through that grid, so the "
                    "merged weights are exactly the trained ones)")
    else:
        exported = "merged into the weights"
    notes = [
        f"LoRA r={cfg.rank} alpha={cfg.alpha:g} on {len(linears)} Linears; loss {cfg.loss}"
        + (f" (kd weight {cfg.kd_weight:g}, T={cfg.temperature:g})" if cfg.loss == "mix" else ""),
        f"{run['steps']} steps, {run['tokens']:,} tokens in {run['seconds']:.0f} s "
        f"(stopped by {run['stopped_by']}); loss {run['loss_start']} -> {run['loss_end']}",
        exported,
    ]
    out = {"modules": per_module, **run, "export": cfg.export, "exported": exported,
           "step_budget": total_steps(cfg, seqlen), "seqlen": seqlen, "train_sequences": int(chunks.shape[0])}
    if ws.masks:
        nmv = pattern_violations(ws.model, [n for n in linears if n in ws.masks], ws.nm)
        out.update(pruned_weights_moved=zeros_moved, nm_violations=nmv if ws.nm else None)
        notes.append(f"pruned weights moved: {zeros_moved}" + (f"; {ws.nm[0]}:{ws.nm[1]} groups broken: {nmv}" if ws.nm else ""))
    out["notes"] = notes
    if before is not None:
        out["perplexity_before"] = before
    return out


METHOD = register(Method(name="recover", config=RecoverStage, run=run_recover, kind="recover"))

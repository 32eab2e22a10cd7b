"""Optional downstream tasks through EleutherAI's lm-evaluation-harness (``lm-eval``).

Only where the package is installed and its task data is reachable (it downloads datasets
from the Hugging Face hub); otherwise a one-line error says which of the two is missing.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from optc.errors import OptcError

log = logging.getLogger(__name__)


def check_lm_eval(tasks: list[str]) -> None:
    """Refuse ``--tasks`` before any work when lm-eval is not installed."""
    if importlib.util.find_spec("lm_eval") is None:
        raise OptcError(
            f"--tasks {','.join(tasks)} needs lm-eval, which is not installed (pip install lm-eval)"
        )


def run_tasks(model: torch.nn.Module, tokenizer, tasks: list[str], limit: int | None = None,
              batch_size: int = 1) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` from ``lm_eval.simple_evaluate`` on the in-memory model."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ImportError:
        raise OptcError(
            f"--tasks {','.join(tasks)} needs lm-eval, which is not installed (pip install lm-eval)"
        ) from None
    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit)
    except (OSError, ConnectionError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise OptcError(
            f"lm-eval could not run {','.join(tasks)} (its datasets need the Hugging Face hub or "
            f"a local datasets cache): {first}"
        ) from None
    out: dict[str, dict[str, float]] = {}
    for task, metrics in (results or {}).get("results", {}).items():
        out[task] = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    return out

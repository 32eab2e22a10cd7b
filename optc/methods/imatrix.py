"""An importance matrix for llama.cpp, measured by optc: each decoder Linear's mean squared input
per column over the calibration text, on the float model, written as llama.cpp's GGUF imatrix
(what ``llama-imatrix`` writes and ``llama-quantize --imatrix`` reads).

The statistic is Wanda's feature norm (:class:`optc.calibrate.stats.FeatureNormAccumulator`), the
sum of ``x_j^2`` over every calibration token and the token count, collected layer by layer by the
sequential engine without changing a weight.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from optc.calibrate.sequential import LayerStep
    from optc.methods.workspace import Workspace


def measure_imatrix(ws: Workspace, path: Path, dataset_name: str = "") -> dict:
    """Write the imatrix of ``ws.model`` on ``ws.calibration``'s text to ``path``; a summary."""
    import gguf

    from optc.calibrate.sequential import run_sequential
    from optc.calibrate.stats import FeatureNormAccumulator
    from optc.errors import OptcError
    from optc.export.gguf_format import check_gguf_model
    from optc.export.imatrix import Imatrix, write_imatrix
    from optc.export.source import ModelSource
    from optc.methods.base import LinearsConfig
    from optc.model.anatomy import weight_2d

    src = ModelSource(ws.model, ws.tokenizer)
    arch, _ = check_gguf_model(src)
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name_map = gguf.get_tensor_name_map(arch_id, ws.model.config.num_hidden_layers)
    sums, counts = {}, {}

    def observe(step: LayerStep) -> dict:
        names = list(step.linears)
        accs = step.collect(names, lambda n, m: FeatureNormAccumulator(weight_2d(m).shape[1]))
        for n in names:
            gname = name_map.get_name(n)
            if gname is None:
                raise OptcError(f"imatrix: {n} has no llama.cpp tensor name")
            sums[f"{gname}.weight"] = accs[n].sq_sum.float()
            counts[f"{gname}.weight"] = float(accs[n].count)
        return {}

    ids = ws.calibration_ids()
    run_sequential(
        ws.model, ids, observe, targets=LinearsConfig().targets, ignore=[src.head] if src.head else [],
        batch_size=ws.calibration.resolved_batch_size(ws.device), device=ws.device, propagate=False,
        autocast=ws.calibration.autocast_dtype(), progress=ws.progress, description="imatrix",
    )
    write_imatrix(path, Imatrix(sums, counts, [dataset_name or ws.calibration.datasets()[0]],
                                int(ids.shape[0]), int(ids.shape[1])))
    return {"path": str(path), "entries": len(sums), "chunks": int(ids.shape[0]), "chunk_size": int(ids.shape[1])}

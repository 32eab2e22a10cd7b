"""llama.cpp's importance matrix files (the GGUF imatrix of current llama.cpp), read and written.

Layout (llama.cpp ``tools/imatrix/imatrix.cpp``, loaded by ``common/imatrix-loader.cpp``): a GGUF
file with ``general.type = "imatrix"``, the string array ``imatrix.datasets`` and the uint32s
``imatrix.chunk_count`` and ``imatrix.chunk_size``; for each weight (by its GGUF tensor name) an
F32 tensor ``<name>.in_sum2`` of the sums of the squared inputs of each input column, and an F32
``<name>.counts`` of how many input rows were summed (one per expert; dense models have one).
``llama-quantize`` weighs column ``j`` by ``in_sum2[j] / counts``: the mean squared input, i.e.
``diag(X^T X) / n``, half the diagonal of optc's GPTQ Hessian ``2 X^T X / n``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from optc.errors import OptcError
from optc.model.gguf_index import read_gguf_index

if TYPE_CHECKING:
    import torch


@dataclass
class Imatrix:
    """Per-weight sums of squared inputs ([K] float32) and row counts, by GGUF tensor name."""

    sums: dict[str, torch.Tensor]
    counts: dict[str, float]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0

    def importance(self, name: str) -> torch.Tensor:
        """Mean squared input of each column of ``name`` (what llama-quantize weighs by)."""
        count = self.counts[name]
        return self.sums[name] / count if count > 0 else self.sums[name] * 0 + 1


def read_imatrix(path: Path) -> Imatrix:
    """An imatrix file written by ``llama-imatrix`` (or by :func:`write_imatrix`); a file that is not
    one is refused naming what is wrong."""
    import torch

    path = Path(path).expanduser()
    try:
        index = read_gguf_index(path)
    except (OSError, ValueError) as exc:
        raise OptcError(f"cannot read imatrix {path}: {exc} (llama.cpp's legacy .dat imatrix is not read: "
                        "convert it with llama-imatrix --in-file X.dat -o X.gguf)") from None

    kind = index.fields.get("general.type")
    if kind != "imatrix":
        raise OptcError(f"{path} is a GGUF file but not an imatrix (general.type is "
                        f"{kind if kind is not None else 'missing'})")
    datasets = [str(d) for d in index.fields.get("imatrix.datasets", [])]
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, float] = {}
    for t in index.tensors:
        for suffix, into in ((".in_sum2", sums), (".counts", counts)):
            if t.name.endswith(suffix):
                if t.type_name != "F32":
                    raise OptcError(f"imatrix {path}: {t.name} is {t.type_name}, not F32")
                data = torch.from_numpy(index.data(t).astype("float32")).reshape(-1)
                into[t.name.removesuffix(suffix)] = data if into is sums else float(data.sum())
    missing = sorted(set(sums) ^ set(counts))
    if missing:
        raise OptcError(f"imatrix {path}: {missing[0]} has in_sum2 without counts or counts without in_sum2")
    return Imatrix(sums, counts, datasets, int(index.fields.get("imatrix.chunk_count", 0)),
                   int(index.fields.get("imatrix.chunk_size", 0)))


def write_imatrix(path: Path, imatrix: Imatrix) -> Path:
    """Write ``imatrix`` as llama.cpp's GGUF imatrix (what ``llama-quantize --imatrix`` reads)."""
    import gguf
    import numpy as np

    path = Path(path).expanduser()
    writer = gguf.GGUFWriter(str(path), arch="")  # no architecture: imatrix files carry none
    writer.add_type("imatrix")
    writer.add_array("imatrix.datasets", imatrix.datasets or ["optc"])
    writer.add_uint32("imatrix.chunk_count", imatrix.chunk_count)
    writer.add_uint32("imatrix.chunk_size", imatrix.chunk_size)
    for name in sorted(imatrix.sums):
        writer.add_tensor(f"{name}.in_sum2", imatrix.sums[name].float().cpu().numpy().astype(np.float32))
        writer.add_tensor(f"{name}.counts", np.array([imatrix.counts[name]], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def check_imatrix(imatrix: Imatrix, columns: dict[str, int], path: Path | str = "imatrix") -> None:
    """Refuse an imatrix made for another model: every weight to quantize (GGUF name -> row length)
    needs an entry of its row length; the first mismatch is named."""
    for name, k in columns.items():
        if name not in imatrix.sums:
            raise OptcError(f"imatrix {path} has no entry for {name}: made for another model?")
        got = imatrix.sums[name].numel()
        if got != k:
            raise OptcError(f"imatrix {path}: {name} has {got} columns, the model's has {k} (another model's imatrix)")

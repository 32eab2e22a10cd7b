"""examples/release.sh: the CI script users copy (compress, evaluate, gate, package)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path


SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "release.sh"


def _release(tmp_path: Path, model: Path, gates: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPTC": f"{sys.executable} -m optc", "MODEL": str(model), "BASELINE": str(model),
           "WINDOWS": "2", "SEQLEN": "64", "GATES": gates}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)


def test_release_packages_checkpoint_reports_and_manifest(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "dist"
    proc = _release(tmp_path, tiny_checkpoint, "kl_mean<=10;top1_agreement>=10%", "w4a16-rtn", str(out))
    assert proc.returncode == 0, proc.stderr
    root = out / "w4a16-rtn"
    assert (root / "checkpoint" / "config.json").is_file() and (root / "evaluation" / "report.json").is_file()
    lines = (root / "SHA256SUMS").read_text().splitlines()
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    assert sorted(line.split("  ", 1)[1] for line in lines) == files
    for line in lines:
        digest, rel = line.split("  ", 1)
        assert hashlib.sha256((root / rel).read_bytes()).hexdigest() == digest
    with tarfile.open(out / "w4a16-rtn.tar.gz") as tar:
        assert "w4a16-rtn/SHA256SUMS" in tar.getnames()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no work directory left
    # Releasing again into the same place is a usage error, not an overwrite.
    assert _release(tmp_path, tiny_checkpoint, "kl_mean<=10", "w4a16-rtn", str(out)).returncode == 2


def test_release_exit_codes(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "dist"
    failed = _release(tmp_path, tiny_checkpoint, "kl_mean<=0", "w4a16-rtn", str(out))
    assert failed.returncode == 3, failed.stderr
    assert (out / "w4a16-rtn.rejected" / "report.md").is_file() and not (out / "w4a16-rtn").exists()
    assert "gate kl_mean<=0: FAILED" in failed.stdout + failed.stderr
    assert _release(tmp_path, tiny_checkpoint, "", "w4a16-rtn").returncode == 2
    assert _release(tmp_path, tiny_checkpoint, "", "no-such-recipe", str(out)).returncode == 1

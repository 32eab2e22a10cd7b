"""Whether the Hugging Face Hub can be reached, asked once before anything downloads.

Without a network, ``huggingface_hub`` and ``datasets`` retry every request and log each retry:
20 to 45 lines over 30 to 50 seconds before the error. A hub id or a named dataset is therefore
checked here first with one short connection (to the proxy, when one is set), and refused in one
line with the hint to pass a local path. ``HF_HUB_OFFLINE=1`` skips the check: the libraries then
read their local cache without any network request.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from urllib.parse import urlsplit

from optc.errors import OptcError

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT_S = 3.0

_TRUE = {"1", "on", "yes", "true"}


def offline_mode() -> bool:
    """Whether the user asked the Hugging Face libraries to stay offline (use their cache only)."""
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT


def _host_port(url: str) -> tuple[str, int] | None:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if not parts.hostname:
        return None
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def _connects(host: str, port: int, timeout: float) -> bool:
    """One TCP connection, name lookup included, within ``timeout`` seconds (getaddrinfo has no
    timeout of its own, so the attempt runs in a thread that is abandoned when late)."""
    outcome: list[bool] = []

    def attempt() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                outcome.append(True)
        except OSError:
            outcome.append(False)

    worker = threading.Thread(target=attempt, daemon=True, name="optc-network-check")
    worker.start()
    worker.join(timeout)
    return bool(outcome and outcome[0])


def reachable(url: str | None = None, timeout: float = TIMEOUT_S) -> bool:
    """Whether a connection to ``url`` (default: the hub endpoint), or to the HTTPS proxy set for
    it, opens within ``timeout`` seconds."""
    url = url or endpoint()
    proxy = next((os.environ[k] for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
                  if os.environ.get(k)), None)
    where = _host_port(proxy or url)
    return where is not None and _connects(*where, timeout)


def require_hub(what: str, hint: str) -> None:
    """Refuse at once to fetch ``what`` from the hub when it cannot be reached (unless offline mode
    is on, where the libraries read their cache and fail fast themselves)."""
    if offline_mode():
        return
    if not reachable():
        raise OptcError(
            f"{what} would be downloaded from {endpoint()}, which cannot be reached (no network?): "
            f"{hint} (or, if it is in the local Hugging Face cache, set HF_HUB_OFFLINE=1)"
        )

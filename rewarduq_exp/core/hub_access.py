"""Is the Hugging Face hub reachable? Asked once per process, before the first hub download.

Without network, ``huggingface_hub`` retries every request with back-off (five retries, 1+2+4+8+8 s) and logs each
retry, so a run on a machine without network spent 50 s and printed 10 warning lines before our one-line error.
Here one TCP connection to the hub endpoint (``HF_ENDPOINT``, default https://huggingface.co; the proxy instead when
``HTTPS_PROXY`` is set) with a short timeout decides: if it fails, the process switches ``huggingface_hub``,
``transformers`` and ``datasets`` to offline mode, so files already in the local cache still load and anything else
fails at once with the usual "not in the cache" error, which the callers turn into one line.

Nothing changes when the user set ``HF_HUB_OFFLINE`` themselves, or when the endpoint answers.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

TIMEOUT_S = 3.0
_state: dict[str, str] = {}  # "mode": online | offline-by-user | offline-unreachable, decided once


def connect_problem(host: str, port: int, seconds: float = TIMEOUT_S) -> str | None:
    """Why ``host:port`` accepts no connection within ``seconds`` in all (None when it does): name lookup and every
    address included. A network that drops packets makes each address of a host wait for the socket timeout in turn
    (minutes for a host with several), and a lookup itself has no timeout; so the probe runs in a daemon thread, left
    behind once the deadline passes."""
    found: dict[str, str | None] = {}

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=seconds).close()
            found["problem"] = None
        except OSError as err:
            found["problem"] = str(err) or type(err).__name__

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(seconds)
    return found.get("problem", f"no answer within {seconds:g} s")


def _host_port(url: str, default_host: str = "") -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or default_host, parts.port or (443 if parts.scheme == "https" else 80)


def url_answers(url: str, seconds: float = TIMEOUT_S) -> bool:
    """Whether what ``urllib`` would connect to for ``url`` (its proxy where the environment names one, as
    ``urlopen`` does, else its host) accepts a connection within ``seconds`` in all (:func:`connect_problem`)."""
    from urllib.request import getproxies, proxy_bypass

    host, port = _host_port(url)
    if not host:
        return False
    proxy = getproxies().get(urlsplit(url).scheme)
    if proxy and not proxy_bypass(host):
        host, port = _host_port(proxy if "://" in proxy else f"http://{proxy}")
    return connect_problem(host, port, seconds) is None


def _endpoint() -> tuple[str, int]:
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    return _host_port(proxy or os.environ.get("HF_ENDPOINT") or "https://huggingface.co", "huggingface.co")


def go_offline() -> None:
    """Offline mode for this process: the environment (for modules imported later) and the loaded libraries."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets.config
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    datasets.config.HF_DATASETS_OFFLINE = True


def hub_reachable() -> bool:
    """True when the hub endpoint accepts a connection (checked once; False also switches to offline mode)."""
    if "mode" not in _state:
        if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
            _state["mode"] = "offline-by-user"
        else:
            host, port = _endpoint()
            err = connect_problem(host, port)
            if err is None:
                _state["mode"] = "online"
            else:
                _state["mode"] = "offline-unreachable"
                log.warning("the Hugging Face hub (%s:%d) does not answer (%s): working offline, only files already "
                            "in the local cache load", host, port, err)
                go_offline()
    return _state["mode"] == "online"


def offline_hint() -> str:
    """Why a hub file could not be fetched, for one-line error messages ("" when the hub was reachable)."""
    mode = _state.get("mode")
    if mode == "offline-unreachable":
        host, port = _endpoint()
        return f"no network: {host}:{port} does not answer; "
    if mode == "offline-by-user":
        return "HF_HUB_OFFLINE is set; "
    return ""

"""Whether the Hugging Face hub can be reached, found out in seconds, before anything asks it.

Without a network, `huggingface_hub` retries each request five times with growing pauses:
about 50 s and twenty warnings before `from_pretrained` or `load_dataset` gives up. One
plain TCP connection to the hub's host (or to the proxy the HTTP client would use) tells the
same thing in at most HUB_PROBE_TIMEOUT_S, so a hub name is then loaded from the local cache
only, or refused in one line. Where the user has asked for offline mode (HF_HUB_OFFLINE,
TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE) nothing is probed: the cache is all there is.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional
from urllib.parse import urlsplit

# Well under the 5 s a user waits before wondering; a reachable hub answers a TCP connect in
# milliseconds, even across continents.
HUB_PROBE_TIMEOUT_S = 3.0
# A data config can name the hub several times (the tokenizer, the dataset, eval sets): one
# probe answers for all of them, not one slow timeout each.
PROBE_REUSE_S = 60.0
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass
class HubStatus:
    """What a probe found: `reason` is None when the hub answered."""

    endpoint: str
    reason: Optional[str] = None

    @property
    def reachable(self) -> bool:
        return self.reason is None

    def describe(self) -> str:
        """For an error line: 'the Hugging Face hub at <endpoint> is unreachable: <reason>'."""
        return f"the Hugging Face hub at {self.endpoint} is unreachable: {self.reason}"


def offline_variable() -> Optional[str]:
    """The offline switch the user set (its name), or None. Read from the environment at each
    call, and from huggingface_hub's own reading of it at import."""
    for name in OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().upper() in _TRUE:
            return name
    from huggingface_hub import constants

    return "HF_HUB_OFFLINE" if constants.HF_HUB_OFFLINE else None


def hub_endpoint() -> str:
    """The hub the libraries will ask: HF_ENDPOINT as huggingface_hub read it, else its default."""
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _connect_target(endpoint: str) -> tuple[str, int]:
    """Where the HTTP client would open its connection for `endpoint`: the proxy the
    environment names for it (unless no_proxy exempts the host), else the host itself."""
    url = urlsplit(endpoint)
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(host):
        proxy_url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if proxy_url.hostname:
            return proxy_url.hostname, proxy_url.port or (443 if proxy_url.scheme == "https" else 80)
    return host, port


_recent: dict[tuple[str, str, int], tuple[float, HubStatus]] = {}


def probe_hub(endpoint: Optional[str] = None, timeout_s: float = HUB_PROBE_TIMEOUT_S) -> HubStatus:
    """Whether one TCP connection to the hub opens within `timeout_s` in all; the answer is
    reused for PROBE_REUSE_S."""
    endpoint = endpoint or hub_endpoint()
    host, port = _connect_target(endpoint)
    key = (endpoint, host, port)
    now = time.monotonic()
    if key in _recent and now - _recent[key][0] < PROBE_REUSE_S:
        return _recent[key][1]
    status = _probe(endpoint, host, port, timeout_s)
    _recent[key] = (now, status)
    return status


def _probe(endpoint: str, host: str, port: int, timeout_s: float) -> HubStatus:
    """The name lookup has no timeout of its own (a broken resolver can hang for tens of
    seconds), so the whole attempt runs in a daemon thread that is given up on at the deadline."""
    if not host:
        return HubStatus(endpoint, f"no host in {endpoint!r}")
    outcome: list[Optional[str]] = []

    def attempt() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(None)
        except OSError as err:
            outcome.append(_reason(err, host, port, timeout_s))

    thread = threading.Thread(target=attempt, name="hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return HubStatus(endpoint, f"no answer from {host}:{port} within {timeout_s:g} s")
    return HubStatus(endpoint, outcome[0])


def _reason(err: OSError, host: str, port: int, timeout_s: float) -> str:
    if isinstance(err, socket.gaierror):
        return f"cannot resolve {host}: {err.strerror or err}"
    if isinstance(err, (socket.timeout, TimeoutError)):
        return f"no answer from {host}:{port} within {timeout_s:g} s"
    if isinstance(err, ConnectionRefusedError):
        return f"connection to {host}:{port} refused"
    return f"{host}:{port}: {err.strerror or err}"


@contextmanager
def offline_mode() -> Iterator[None]:
    """Within: huggingface_hub and `datasets` read only their caches, as under HF_HUB_OFFLINE=1.

    Both read the variable once, at import, into module constants; those are what their
    code consults at each call, so they are what is switched here (and switched back).
    """
    from huggingface_hub import constants

    saved_hub = constants.HF_HUB_OFFLINE
    datasets_config = sys.modules.get("datasets.config")
    saved_datasets = getattr(datasets_config, "HF_HUB_OFFLINE", None)
    constants.HF_HUB_OFFLINE = True
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved_hub
        if datasets_config is not None:
            datasets_config.HF_HUB_OFFLINE = saved_datasets

"""`metrics --serve PORT`: every scrape a new check; prometheus.py's text read back by
prometheus-client's parser, so both outputs have one shape."""

from __future__ import annotations

import threading
import time
from typing import Callable

from dflash_ops.errors import DflashOpsError

INSTALL_HINT = "pip install 'dflash-ops[prometheus]' (prometheus-client)"


class _Collector:
    def __init__(self, render: Callable[[], str]):
        self.render = render
        self.lock = threading.Lock()  # overlapping scrapes check the targets one at a time

    def collect(self):
        from prometheus_client.parser import text_string_to_metric_families

        with self.lock:
            text = self.render()
        yield from text_string_to_metric_families(text)


def serve(render: Callable[[], str], port: int, address: str = "127.0.0.1", ready=None) -> None:
    """Serve until interrupted. `ready(port)` is called once the server listens."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise DflashOpsError(f"--serve needs prometheus-client: {INSTALL_HINT}") from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(render))
    try:
        start_http_server(port, addr=address, registry=registry)
    except OSError as exc:
        raise DflashOpsError(
            f"--serve {port}: cannot listen on {address}:{port}: {exc.strerror or exc}"
        ) from None
    if ready is not None:
        ready(port)
    while True:
        time.sleep(3600)

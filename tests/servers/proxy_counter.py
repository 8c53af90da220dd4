"""A proxy.py plugin that writes down every request it forwards (loaded by the proxy).

proxy.py's access log has one line per client connection, not per request: requests
that follow on a kept-alive connection are forwarded without a log line. This plugin's
``handle_client_request`` runs for each of them, so the file named by
``$PYG_ATOMPACK_PROXY_LOG`` gets one ``METHOD host:port/path`` line per forwarded request.
"""

from __future__ import annotations

import os

from proxy.http.proxy import HttpProxyBasePlugin


class CountingPlugin(HttpProxyBasePlugin):
    """Appends one line per forwarded request to ``$PYG_ATOMPACK_PROXY_LOG``."""

    def handle_client_request(self, request):
        def text(value) -> str:
            return bytes(value or b"").decode("latin-1")

        line = f"{text(request.method)} {text(request.host)}:{request.port}{text(request.path)}\n"
        with open(os.environ["PYG_ATOMPACK_PROXY_LOG"], "a", encoding="utf-8") as handle:
            handle.write(line)
        return request

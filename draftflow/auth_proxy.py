"""A loopback proxy that adds an API key to every request to an external endpoint.

speculators' generation client sends no credentials; it talks to this proxy
instead, so the key stays in memory: it is never on a command line, in a log
or in the config (which names only the environment variable that holds it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Iterator

from aiohttp import ClientSession, ClientTimeout, web

HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "authorization"}


def api_key_from_env(variable: str) -> str:
    key = os.environ.get(variable)
    if not key:
        raise KeyError(
            f"generate.api_key_env names the environment variable {variable}, but it is "
            "not set: export it before running the workflow."
        )
    return key


def proxy_app(upstream: str, api_key: str) -> web.Application:
    async def forward(request: web.Request) -> web.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Authorization"] = f"Bearer {api_key}"
        session: ClientSession = request.app["session"]
        async with session.request(
            request.method, upstream.rstrip("/") + request.rel_url.path_qs, headers=headers, data=await request.read()
        ) as reply:
            body = await reply.read()
            return web.Response(body=body, status=reply.status, content_type=reply.content_type)

    async def open_session(app: web.Application):
        app["session"] = ClientSession(timeout=ClientTimeout(total=None))
        yield
        await app["session"].close()

    app = web.Application(client_max_size=1 << 30)
    app.cleanup_ctx.append(open_session)
    app.router.add_route("*", "/{path:.*}", forward)
    return app


@contextlib.contextmanager
def authenticating_proxy(upstream: str, api_key: str) -> Iterator[str]:
    """Serve the proxy on 127.0.0.1 for the ``with`` block; yield its base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(proxy_app(upstream, api_key))
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - aiohttp exposes no bound port
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()

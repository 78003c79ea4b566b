"""ASGI middleware: the request body size limit (--max-body-bytes)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import too_large


class BodySizeLimit:
    """Refuses a body over ``max_bytes`` with a 413 in OpenAI's error shape before the app parses any of it:
    at once when Content-Length says so, else as soon as the chunks received pass the limit. The body is
    read here and replayed to the app, which reads it whole anyway; later receive() calls (the disconnect
    watch) go straight through."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(self.max_bytes).response()(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await too_large(self.max_bytes).response()(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

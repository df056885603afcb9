"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``: load and unload a
LoRA adapter at run time over HTTP, under vLLM's names and bodies.

Owner: the HTTP app. Written against the public SDK only (``Runtime.load_adapter`` and
``Runtime.unload_adapter`` over the app's runtime): an adapter is engine-wide, so one
loaded here is at once a ``model`` for ``/v1/chat/completions`` and ``/v1/completions``,
a card of ``/v1/models``, and ``Context(rt, adapter=NAME)`` for every inferlet; one loaded
by an inferlet is visible here the same way (the OpenAI routes read the engine's table at
each request). The API key rules are the app's, as for hosted inferlets: with a key, these
routes need it like every data route; on loopback without ``--api-key-file`` they are open.

Bodies (JSON): load ``{"lora_name": "terse", "lora_path": "/adapters/terse"}`` (a PEFT folder
read by the server's process); unload ``{"lora_name": "terse"}``. ``load_inplace`` (vLLM's
"replace the weights of a loaded name") is refused: unload first.

Replies: 200 with vLLM's plain text, ``Success: LoRA adapter 'NAME' added successfully.`` or
``... removed successfully.``. Errors use OpenAI's body: 400 for a bad body, a name already
loaded (the message says so), or a folder that is missing or not a LoRA pie-ctx runs
(``adapter_load_failed``, the message says which file and why); 404 ``adapter_not_found``
for an unload of a name not loaded; 409 ``adapter_in_use`` while contexts use it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pie_ctx import Runtime
from pie_ctx.proto.errors import AdapterInUse, AdapterNotFound, InvalidArgument, ModelError
from runtime.server.http.conversation.errors import error_response

__all__ = ["AdapterRoutes"]

_MAX_BODY = 64 << 10


class AdapterRoutes:
    """The two routes over one runtime (``get_runtime()`` is called per request)."""

    def __init__(self, get_runtime: Callable[[], Runtime]) -> None:
        from starlette.routing import Route

        self.get_runtime = get_runtime
        self.routes = [Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
                       Route("/v1/unload_lora_adapter", self.unload, methods=["POST"])]

    @staticmethod
    async def _body(request: Any, keys: tuple[str, ...]) -> dict[str, str]:
        """The JSON body's ``keys``, each a non-empty str."""
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > _MAX_BODY:
                raise InvalidArgument(f"the body is over {_MAX_BODY} bytes")
        shape = "{" + ", ".join(f'"{k}": "..."' for k in keys) + "}"
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            raise InvalidArgument(f"the body must be JSON: {shape}") from None
        if not isinstance(body, dict):
            raise InvalidArgument(f"the body must be a JSON object: {shape}")
        if body.get("load_inplace"):
            raise InvalidArgument("load_inplace is not supported: unload the adapter "
                                  "(/v1/unload_lora_adapter), then load the new folder")
        extra = set(body) - set(keys) - {"load_inplace", "lora_int_id"}
        if extra:
            raise InvalidArgument(f"unknown field(s) {sorted(extra)}; the body is {shape}")
        for key in keys:
            if not isinstance(body.get(key), str) or not body[key]:
                raise InvalidArgument(f'"{key}" must be a non-empty string; the body is {shape}')
        return {key: body[key] for key in keys}

    @staticmethod
    def _refused(err: Exception) -> Any:
        if isinstance(err, AdapterNotFound):
            return error_response(404, str(err), "invalid_request_error", "lora_name",
                                  "adapter_not_found")
        if isinstance(err, AdapterInUse):
            return error_response(409, str(err), "invalid_request_error", "lora_name",
                                  "adapter_in_use")
        if isinstance(err, ModelError):
            return error_response(400, str(err), "invalid_request_error", "lora_path",
                                  "adapter_load_failed")
        return error_response(400, str(err), "invalid_request_error")

    async def load(self, request: Any) -> Any:
        from starlette.responses import PlainTextResponse

        try:
            body = await self._body(request, ("lora_name", "lora_path"))
            await self.get_runtime().load_adapter(body["lora_name"], body["lora_path"])
        except (InvalidArgument, ModelError) as err:
            return self._refused(err)
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added "
                                 "successfully.")

    async def unload(self, request: Any) -> Any:
        from starlette.responses import PlainTextResponse

        try:
            body = await self._body(request, ("lora_name",))
            await self.get_runtime().unload_adapter(body["lora_name"])
        except (InvalidArgument, AdapterInUse) as err:
            return self._refused(err)
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed "
                                 "successfully.")

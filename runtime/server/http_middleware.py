"""The HTTP layer under every route: JSON bodies read within --max-body-bytes and answered, errors answered as
OpenAI error objects, the API key checked (bearer token, or an HTTP Basic password on GET for browsers)."""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import os
from typing import Any, Optional

import msgspec
from aiohttp import web

from braid.runtime.server.errors import APIError, bad_request, body_too_large, from_exception, unauthorized
from braid.runtime.server.sse import json_bytes
from braid.runtime.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger("braid.server")

TM_KEY = web.AppKey("tokenizer_manager", TokenizerManager)


_PUBLIC_PATHS = frozenset({"/health"})


def json_response(body, status: int = 200) -> web.Response:
    return web.Response(body=json_bytes(body), status=status, content_type="application/json")


def error_response(err: APIError) -> web.Response:
    resp = json_response(err.to_dict(), status=err.status)
    resp.headers.update(err.headers or {})
    return resp


async def read_json(request: web.Request) -> Any:
    limit = request.app[TM_KEY].server_args.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise body_too_large(limit)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(limit) from None
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise bad_request(f"Request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("Request body is nested too deeply") from None


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        request.app[TM_KEY].metrics.http_errors.inc()
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        request.app[TM_KEY].metrics.http_errors.inc()
        return error_response(APIError(e.reason, e.status))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        request.app[TM_KEY].metrics.http_errors.inc()
        return error_response(from_exception(e))


def auth_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path not in _PUBLIC_PATHS:
            given = request.headers.get("Authorization", "")
            if not (hmac.compare_digest(given.encode(), expected) or _basic_auth_ok(request, given, api_key)):
                err = unauthorized()
                if request.path == "/dashboard":  # a browser asks its user for the key (as the password)
                    err.headers = {**(err.headers or {}), "WWW-Authenticate": 'Basic realm="braid", charset="UTF-8"'}
                return error_response(err)
        return await handler(request)

    return check


def _basic_auth_ok(request: web.Request, given: str, api_key: str) -> bool:
    """GET requests may carry the key as an HTTP Basic password (any user name): what a browser sends for the
    dashboard and the routes its page polls."""
    if request.method != "GET" or not given.startswith("Basic "):
        return False
    try:
        password = base64.b64decode(given[6:], validate=True).decode().partition(":")[2]
    except (ValueError, UnicodeDecodeError):
        return False
    return hmac.compare_digest(password.encode(), api_key.encode())


API_KEY_ENV = "BRAID_API_KEY"


def resolve_api_key(server_args) -> Optional[str]:
    """--api-key, else the first line of --api-key-file, else $BRAID_API_KEY (the last two stay out of `ps`)."""
    if server_args.api_key:
        return server_args.api_key
    if server_args.api_key_file:
        with open(server_args.api_key_file) as f:
            key = f.readline().strip()
        if not key:
            raise ValueError(f"--api-key-file {server_args.api_key_file} holds no key on its first line")
        return key
    return os.environ.get(API_KEY_ENV) or None

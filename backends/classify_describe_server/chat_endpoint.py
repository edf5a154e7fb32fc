"""The describe step's client of the chat-completions endpoint: a whole answer
as one aiohttp POST, a streamed one through the openai SDK.

Why not the SDK for both: its post() spent about 2 ms of CPU per call on a
2-core AMD EPYC (its httpx layer over aiohttp, the request builder, pydantic
models of the answer), 5x a plain aiohttp POST with orjson
(docs/benchmarks-method.md#the-describe-steps-http-client), and it is on the
path of every ensemble request. The whole answer is small and its format
fixed, so it is read here; a stream keeps the SDK's SSE parsing and chunk
types. Both send the same request (the SDK's own headers, its key among
them) and fail the same way: a status error is the SDK's own exception,
built by the SDK from the response, a connection failure or a timeout its
APIConnectionError or APITimeoutError, so the describer classifies one as
it does the other (Describer.classify_failure).
"""

import types

import aiohttp
import aiohttp.helpers
import httpx2
import openai
import orjson
import yarl

from .resilience import AnswerTooLarge, UnreadableAnswer

# httpx's keep-alive expiry, which the SDK's aiohttp pool uses too.
KEEPALIVE_S = 5.0
# Headers that describe the body as it came over the wire, not as aiohttp hands it over.
DECODED = ("content-encoding", "content-length", "transfer-encoding")


class ChatEndpoint:
    """post() as the SDK's AsyncOpenAI.post, for the two calls the describe step makes."""

    def __init__(self, sdk, max_connections, connect_timeout_s, max_response_bytes, keyless=False):
        self.sdk = sdk
        self.url = str(sdk.base_url).rstrip("/") + "/chat/completions"
        # keyless: an endpoint that takes no key gets no Authorization header, not a made-up token
        # (some servers check one they were not configured for); the SDK wants the omission said.
        self.omitted = {"Authorization": openai.Omit()} if keyless else {}
        # What the SDK sends with every request: its key, User-Agent and platform headers (less
        # those it omits: an Omit value).
        self.headers = {name: value for name, value in {**sdk.default_headers, **sdk.auth_headers, **self.omitted}.items()
                        if isinstance(value, str)}
        self.max_connections, self.connect_timeout_s = max_connections, connect_timeout_s
        self.max_response_bytes = max_response_bytes
        self.proxy, self.proxy_auth = env_proxy(self.url)
        self.session = None  # made in the loop that uses it, on the first call

    def post(self, path, *, cast_to, options, body, stream=False, stream_cls=None):
        if stream:
            if self.omitted:
                options = {**options, "headers": {**options.get("headers", {}), **self.omitted}}
            return self.sdk.post(path, cast_to=cast_to, options=options, body=body, stream=True,
                                 stream_cls=stream_cls)
        return self._whole_answer(options, body)

    async def close(self):
        if self.session is not None:
            await self.session.close()
        await self.sdk.close()

    async def _whole_answer(self, options, body):
        """The chat completion, as attribute access (what the readers of an SDK object use)."""
        timeout = aiohttp.ClientTimeout(total=options["timeout"], connect=self.connect_timeout_s)
        try:
            async with self._session().post(self.url, data=orjson.dumps(body), timeout=timeout,
                                            headers={**self.headers, **options.get("headers", {})},
                                            proxy=self.proxy, proxy_auth=self.proxy_auth) as response:
                raw = await _read_at_most(response.content, self.max_response_bytes)
                if response.status >= 400:
                    raise self._status_error(response, raw)
        except TimeoutError as exc:
            raise openai.APITimeoutError(request=self._request()) from exc
        except aiohttp.ClientError as exc:
            raise openai.APIConnectionError(request=self._request()) from exc
        try:
            return _attributes(orjson.loads(raw))
        except orjson.JSONDecodeError:  # not JSON, or not UTF-8
            raise UnreadableAnswer(len(raw)) from None

    def _session(self):
        if self.session is None:
            connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=KEEPALIVE_S,
                                             ssl=httpx2.create_ssl_context())
            self.session = aiohttp.ClientSession(connector=connector)
        return self.session

    def _request(self):
        return httpx2.Request("POST", self.url)

    def _status_error(self, response, raw):
        """The SDK's exception for this answer (RateLimitError for a 429, ...), message and body as it makes them."""
        # aiohttp has decoded the body already: its encoding and length headers would have httpx
        # decode it again (a gzipped 429 read as a broken body, its Retry-After lost).
        headers = [(name, value) for name, value in response.headers.items() if name.lower() not in DECODED]
        answer = httpx2.Response(response.status, headers=headers, content=raw, request=self._request())
        return self.sdk._make_status_error_from_response(answer)


def env_proxy(url):
    """(proxy URL, its auth) that HTTP(S)_PROXY and NO_PROXY name for `url`, (None, None) for
    none: as the SDK's httpx reads them on the stream path. Read once: aiohttp's trust_env
    reads them, and ~/.netrc, on every request in two thread hops (about 0.25 ms of CPU), and
    a netrc entry for the LLM's host would clash with the key's Authorization header."""
    try:
        return aiohttp.helpers.get_env_proxy_for_url(yarl.URL(url))
    except LookupError:
        return None, None


async def _read_at_most(content, limit):
    """The body, refused with AnswerTooLarge before reading past `limit` bytes."""
    chunks, size = [], 0
    async for chunk in content.iter_any():
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(f"the upstream's response passed {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _attributes(value):
    """JSON objects as namespaces: answer.choices[0].message.content, as on the SDK's models."""
    if isinstance(value, dict):
        return types.SimpleNamespace(**{key: _attributes(item) for key, item in value.items()})
    if isinstance(value, list):
        return [_attributes(item) for item in value]
    return value

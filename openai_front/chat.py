"""A chat-completions request body -> what the pipeline needs: the image
(bytes from a data: URI, or an allowlisted http(s) URL to fetch), the prompt
(the text parts of the last user message) and the sampling overrides the
describe step accepts. Pure: no I/O, no Triton."""

import base64
import binascii
import dataclasses
import ipaddress
import math
import urllib.parse

from .errors import FrontError, invalid, too_large

MAX_TOKENS_LIMIT = 2**31 - 1  # far above any model's output; the describe step then applies its own limit
DEFAULT_PORTS = (80, 443)     # the only ports of an allowlisted host, unless an entry says host:port


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    model: str
    image: bytes = None          # decoded from a data: URI
    image_url: str = None        # an allowlisted http(s) URL, fetched by the app
    prompt: str = None           # None: the describe step's default question
    stream: bool = False
    include_usage: bool = False
    parameters: dict = dataclasses.field(default_factory=dict)  # Triton request parameters


def parse(body, max_image_bytes, url_allowlist=frozenset(), allow_private_addresses=False):
    """Validate one decoded JSON body; raise FrontError (4xx) naming the field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required: a string, e.g. 'classify_and_describe' (GET /v1/models lists them)",
                      param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty array", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"messages[{index}] must be an object with a 'role'", param=f"messages[{index}]")
    user = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not user:
        raise invalid("no message has role 'user': the last user message carries the image", param="messages")
    index = user[-1]
    prompt, image_url = _user_content(messages[index].get("content"), f"messages[{index}].content")

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("'stream' must be true or false", param="stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(options, dict):
            raise invalid("'stream_options' must be an object", param="stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise invalid("'stream_options.include_usage' must be true or false", param="stream_options.include_usage")
    n = body.get("n")
    if n is not None and n != 1:
        raise invalid("only n=1 is supported: one image, one description", param="n")

    image = None
    if image_url.startswith("data:"):
        image = decode_data_uri(image_url, max_image_bytes, param=f"messages[{index}].content")
        image_url = None
    else:
        check_remote_url(image_url, url_allowlist, param=f"messages[{index}].content",
                         allow_private_addresses=allow_private_addresses)
    return ChatRequest(model=model, image=image, image_url=image_url, prompt=prompt, stream=stream,
                       include_usage=include_usage, parameters=_sampling(body))


def _user_content(content, param):
    """(prompt or None, the image part's url) from a user message's content."""
    if isinstance(content, str) or content is None:
        raise invalid("the last user message has no image: send its content as an array with one "
                      "{'type': 'image_url', 'image_url': {'url': 'data:image/jpeg;base64,...'}} part", param=param)
    if not isinstance(content, list):
        raise invalid("'content' must be a string or an array of parts", param=param)
    texts, urls = [], []
    for position, part in enumerate(content):
        where = f"{param}[{position}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise invalid("a text part needs 'text', a string", param=where)
            try:
                part["text"].encode("utf-8")
            except UnicodeEncodeError:  # JSON's \ud800 escapes decode to lone surrogates
                raise invalid("a text part is not valid Unicode: it holds a lone surrogate (\\ud800-\\udfff)",
                              param=where) from None
            texts.append(part["text"])
        elif kind == "image_url":
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url  # the old form: a bare string
            if not isinstance(url, str) or not url:
                raise invalid("an image_url part needs 'image_url': {'url': ...}", param=where)
            urls.append(url)
        else:
            raise invalid(f"unsupported content part type {kind!r}: only 'text' and 'image_url'", param=where)
    if not urls:
        raise invalid("the last user message has no image_url part", param=param)
    if len(urls) > 1:
        raise invalid(f"the last user message has {len(urls)} images; send one per request", param=param)
    prompt = "\n".join(t for t in texts if t.strip()).strip()
    return prompt or None, urls[0]


def decode_data_uri(uri, max_bytes, param=None):
    """The bytes of `data:[<media type>][;base64],<data>`. The size is checked
    on the encoded text first, so a huge URI is refused before it is decoded."""
    header, comma, data = uri[5:].partition(",")
    if not comma:
        raise invalid("the image's data: URI has no ',' before its data", param=param)
    fields = header.split(";")
    media_type = fields[0].strip().lower()
    if media_type and not media_type.startswith("image/"):
        raise invalid(f"the data: URI's media type is {media_type[:40]!r}, not an image", param=param)
    is_base64 = "base64" in (f.strip().lower() for f in fields[1:])
    if is_base64 and len(data) > 4 * math.ceil(max_bytes / 3) + 4:  # + a little padding and whitespace slack
        raise too_large(f"the image is more than the {max_bytes} bytes allowed", param=param)
    try:
        image = base64.b64decode(data, validate=True) if is_base64 else urllib.parse.unquote_to_bytes(data)
    except (binascii.Error, ValueError):
        raise invalid("the image's data: URI is not valid base64", param=param) from None
    if not image:
        raise invalid("the image's data: URI holds no data", param=param)
    if len(image) > max_bytes:
        raise too_large(f"the image is {len(image)} bytes, more than the {max_bytes} allowed", param=param)
    return image


def check_remote_url(url, allowlist, param=None, allow_private_addresses=False):
    """Only http(s) URLs whose host is on the allowlist, on port 80 or 443 unless
    an entry names `host:port`, and never an IP literal that is not public: the
    front must not be a way to reach hosts its clients cannot (cloud metadata,
    internal services). Names are checked again after DNS (fetch.py)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").lower()
        port = parts.port  # raises ValueError on a malformed port
    except ValueError:
        raise invalid("the image URL is malformed", param=param) from None
    if parts.scheme not in ("http", "https") or not host:
        raise invalid("the image must be a data: URI (data:image/jpeg;base64,...) or an http(s) URL", param=param)
    port = port if port is not None else (443 if parts.scheme == "https" else 80)
    host_port = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if not (host_port in allowlist or (host in allowlist and port in DEFAULT_PORTS)):
        raise FrontError(400, "remote image URLs are refused: send the image as a data: URI "
                              "(the server's OPENAI_FRONT_IMAGE_URL_ALLOWLIST does not list this host, "
                              "or this port: only 80 and 443 unless an entry says host:port)",
                         param=param, code="image_url_not_allowed")
    if _is_ip_literal(host) and not address_allowed(host, allow_private_addresses):
        raise FrontError(400, "the image URL is refused: its host is a loopback, private or otherwise "
                              "non-public address", param=param, code="image_url_not_allowed")


def _is_ip_literal(host):
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def address_allowed(address, allow_private=False):
    """Whether the front may connect to this IP address: public unicast only
    (no loopback, private, link-local, shared, multicast, reserved or
    unspecified address; an IPv4-mapped IPv6 address counts as its IPv4 one).
    allow_private (OPENAI_FRONT_IMAGE_URL_ALLOW_PRIVATE, for tests) lifts that."""
    if allow_private:
        return True
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone id ("fe80::1%eth0")
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_loopback or ip.is_link_local
                                 or ip.is_private or ip.is_unspecified)


def _sampling(body):
    """temperature and max_tokens go to the describe step as Triton request
    parameters; it refuses values outside its configured limits (400)."""
    parameters = {}
    temperature = body.get("temperature")
    if temperature is not None:
        try:  # an integer too long for a float (10**400) is no number either
            valid = not isinstance(temperature, bool) and isinstance(temperature, (int, float)) and math.isfinite(temperature)
        except OverflowError:
            valid = False
        if not valid:
            raise invalid("'temperature' must be a number", param="temperature")
        parameters["temperature"] = float(temperature)
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS_LIMIT:
            raise invalid(f"'{name}' must be a positive integer, at most {MAX_TOKENS_LIMIT}", param=name)
        parameters.setdefault("max_tokens", value)
    return parameters

"""The front's settings, from the environment (and command-line overrides in
__main__). Every name is documented in the README's OpenAI section, but the
three of where it listens and where Triton is: the supervisor passes those as
--host, --port and --triton-grpc-url, so they serve only `python -m openai_front`
run on its own.

  OPENAI_PORT=8003, OPENAI_ADDRESS (default LISTEN_ADDRESS, else 127.0.0.1)
  TRITON_GRPC_URL=127.0.0.1:8001       where Triton's gRPC endpoint is
  TRITON_INFERENCE_KEY                 the key Triton's inference needs, when it
                                       is restricted (the supervisor sets it from
                                       its own TRITON_INFERENCE_KEY(_FILE)); sent
                                       as `triton-grpc-protocol-inference-key`
  OPENAI_FRONT_API_KEY or OPENAI_FRONT_API_KEY_FILE   the key clients send as
                                       `Authorization: Bearer <key>`; without
                                       one the front is open (and says so), and
                                       refuses to start where Triton's inference
                                       has a key (it would answer anyone for it)
  OPENAI_FRONT_OPEN=0                  1: serve open even then, on purpose
  OPENAI_FRONT_IMAGE_URL_ALLOWLIST     comma-separated host names whose
                                       http(s) image URLs may be fetched, on
                                       ports 80 and 443 (`host:port` for
                                       another); empty (default): data: URIs only
  OPENAI_FRONT_IMAGE_URL_ALLOW_PRIVATE=0  1: also fetch from loopback and
                                       private addresses. DANGEROUS (the front
                                       then reaches internal services); for tests
  OPENAI_FRONT_MAX_BODIES_IN_FLIGHT=16  request bodies read and decoded at
                                       once; more wait up to 2 s for a turn, then
                                       are refused (503, Retry-After)
  OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT=1024  the most chat requests at once, each to
                                       its answer or its stream's end; below it the
                                       front passes on as many as Triton takes (it
                                       cuts on Triton's queue refusals); more are
                                       refused (503, Retry-After growing with the
                                       overload) before their body is read
  OPENAI_FRONT_MAX_IMAGE_BYTES_IN_FLIGHT=536870912  what the images of the requests
                                       in flight hold at once (each to its request's
                                       end); a request whose image would pass it is
                                       refused (503, Retry-After)
  OPENAI_FRONT_BODY_TIMEOUT_S=10      a request body must arrive within this
                                       (408 and the connection closed after it), so
                                       slow or stalled senders cannot hold the body slots
  OPENAI_FRONT_MIN_BODY_RATE=32768    bytes a second a body must keep up, on average,
                                       from its first second on, and start within
                                       it (408 and closed otherwise); a body takes
                                       its slot only once its first bytes are in
                                       (0: no pace)
  OPENAI_FRONT_MAX_FETCHES_IN_FLIGHT=8  allowlisted image URLs fetched at once;
                                       more are refused (503, Retry-After)
  OPENAI_FRONT_DRAIN_S=5               at shutdown (TERM): open streams end at once
                                       with an error event; whole answers get this long
  OPENAI_FRONT_MAX_IMAGE_BYTES=20971520  the preprocess step's own limit
  OPENAI_FRONT_MAX_PROMPT_CHARS        a longer question is refused here (400),
                                       before Triton classifies the photo; the
                                       describe step's max_prompt_chars: default
                                       LLM_MAX_PROMPT_CHARS where set, else 2000
  OPENAI_FRONT_GRPC_CHANNELS=2         gRPC channels to Triton, used in turn
  OPENAI_FRONT_TIMEOUT_S=60            one request's deadline at Triton
  OPENAI_FRONT_ACCESS_LOG=1            0: no access log (one JSON line per request
                                       on stderr: openai_front/access_log.py)
"""

import dataclasses
import os

from classify_describe_server.config import ConfigError

from .chat import MAX_PROMPT_CHARS

# The model ids clients may ask for, and the ensembles behind them.
MODELS = {"classify_and_describe": ("classify_and_describe", "classify_and_describe_stream")}


@dataclasses.dataclass(frozen=True)
class Model:
    id: str
    ensemble: str         # answers stream: false
    stream_model: str  # answers stream: true (a decoupled model: docs/streaming.md)


@dataclasses.dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8003
    triton_grpc_url: str = "127.0.0.1:8001"
    triton_inference_key: str = dataclasses.field(default=None, repr=False)  # never printed
    api_key: str = dataclasses.field(default=None, repr=False)  # never printed
    api_key_source: str = ""
    image_url_allowlist: frozenset = frozenset()  # "host" (ports 80, 443) or "host:port"
    image_url_allow_private: bool = False        # dangerous: for tests on loopback only
    max_bodies_in_flight: int = 16
    # The most chat requests at once, whole (shedding.py). Below it the front learns how
    # many Triton takes from its refusals: about 45/s x 1 s of LLM here; raise it for a GPU
    # host behind a slow LLM (hundreds a second x seconds). docs/reliability.md#overload.
    max_requests_in_flight: int = 1024
    # What their images hold in memory at once (each to its request's end), apart from
    # their number: 1024 requests of 20 MiB would be 20 GiB.
    max_image_bytes_in_flight: int = 512 * 1024 * 1024
    max_image_bytes: int = 20 * 1024 * 1024
    max_prompt_chars: int = MAX_PROMPT_CHARS  # the describe step's default max_prompt_chars
    body_timeout_s: float = 10.0
    # A trickle (a byte a second) held a body slot for all of body_timeout_s: 16 of them
    # shut every other body out. At 32 KiB/s a client that holds them all sends 0.5 MB/s.
    min_body_rate: int = 32 * 1024
    max_fetches_in_flight: int = 8
    drain_s: float = 5.0
    grpc_channels: int = 2
    timeout_s: float = 60.0
    remote_fetch_timeout_s: float = 10.0
    access_log: bool = True
    models: tuple = tuple(Model(id, *ensembles) for id, ensembles in MODELS.items())

    def model(self, model_id):
        return next((m for m in self.models if m.id == model_id), None)


def _int(environ, name, default, minimum):
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be at least {minimum}")
    return value


def _bool(environ, name, default):
    raw = environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} must be 1 or 0")


def _allowlist(environ):
    entries = set()
    for entry in environ.get("OPENAI_FRONT_IMAGE_URL_ALLOWLIST", "").split(","):
        entry = entry.strip().lower()
        if not entry:
            continue
        host, colon, port = entry.rpartition(":")
        if colon and not host.endswith(":") and not (port.isdigit() and 0 < int(port) < 65536 and host):
            raise ConfigError(f"OPENAI_FRONT_IMAGE_URL_ALLOWLIST: {entry!r} is neither a host nor host:port")
        entries.add(entry)
    return frozenset(entries)


def _float(environ, name, default):
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise ConfigError(f"{name}={raw} must be a positive number of seconds")
    return value


def load_api_key(environ):
    """(key or None, where it came from). A file path that does not exist
    counts as unset, as for the admin key (an optional Kubernetes Secret); an
    empty or unreadable file is an error, never a silently open front."""
    path = environ.get("OPENAI_FRONT_API_KEY_FILE", "").strip()
    if path and os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                key = f.read().strip()
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"cannot read OPENAI_FRONT_API_KEY_FILE={path}: {error}") from None
        if not key:
            raise ConfigError(f"OPENAI_FRONT_API_KEY_FILE={path} is empty")
        source = f"from OPENAI_FRONT_API_KEY_FILE ({path})"
    elif environ.get("OPENAI_FRONT_API_KEY", "").strip():
        key, source = environ["OPENAI_FRONT_API_KEY"].strip(), "from OPENAI_FRONT_API_KEY"
    else:
        return None, f"none (OPENAI_FRONT_API_KEY_FILE={path} does not exist)" if path else "none"
    if not key.isprintable() or any(c.isspace() for c in key):
        raise ConfigError(f"the API key ({source}) has spaces or control characters")
    return key, source


def from_environ(environ=None, **overrides):
    environ = os.environ if environ is None else environ
    api_key, api_key_source = load_api_key(environ)
    values = dict(
        host=environ.get("OPENAI_ADDRESS") or environ.get("LISTEN_ADDRESS") or "127.0.0.1",
        port=_int(environ, "OPENAI_PORT", 8003, 0),
        triton_grpc_url=environ.get("TRITON_GRPC_URL") or "127.0.0.1:8001",
        triton_inference_key=environ.get("TRITON_INFERENCE_KEY", "").strip() or None,
        api_key=api_key,
        api_key_source=api_key_source,
        image_url_allowlist=_allowlist(environ),
        image_url_allow_private=_bool(environ, "OPENAI_FRONT_IMAGE_URL_ALLOW_PRIVATE", False),
        max_bodies_in_flight=_int(environ, "OPENAI_FRONT_MAX_BODIES_IN_FLIGHT", 16, 1),
        max_requests_in_flight=_int(environ, "OPENAI_FRONT_MAX_REQUESTS_IN_FLIGHT", Settings.max_requests_in_flight, 1),
        max_image_bytes=_int(environ, "OPENAI_FRONT_MAX_IMAGE_BYTES", 20 * 1024 * 1024, 1),
        # The describe step reads LLM_MAX_PROMPT_CHARS from the same environment (the supervisor's).
        max_prompt_chars=_int(environ, "OPENAI_FRONT_MAX_PROMPT_CHARS",
                              _int(environ, "LLM_MAX_PROMPT_CHARS", Settings.max_prompt_chars, 1), 1),
        max_image_bytes_in_flight=_int(environ, "OPENAI_FRONT_MAX_IMAGE_BYTES_IN_FLIGHT",
                                       Settings.max_image_bytes_in_flight, 1),
        body_timeout_s=_float(environ, "OPENAI_FRONT_BODY_TIMEOUT_S", 10.0),
        min_body_rate=_int(environ, "OPENAI_FRONT_MIN_BODY_RATE", Settings.min_body_rate, 0),
        max_fetches_in_flight=_int(environ, "OPENAI_FRONT_MAX_FETCHES_IN_FLIGHT", 8, 1),
        drain_s=_float(environ, "OPENAI_FRONT_DRAIN_S", 5.0),
        grpc_channels=_int(environ, "OPENAI_FRONT_GRPC_CHANNELS", 2, 1),
        timeout_s=_float(environ, "OPENAI_FRONT_TIMEOUT_S", 60.0),
        access_log=_bool(environ, "OPENAI_FRONT_ACCESS_LOG", True),
    )
    values.update({k: v for k, v in overrides.items() if v is not None})
    if values["triton_inference_key"] and not values["api_key"] and not _bool(environ, "OPENAI_FRONT_OPEN", False):
        raise ConfigError("Triton's inference needs a key (TRITON_INFERENCE_KEY) and the front has none: it would "
                          "answer anyone with it. Set OPENAI_FRONT_API_KEY or OPENAI_FRONT_API_KEY_FILE, or "
                          "OPENAI_FRONT_OPEN=1 to serve the front open on purpose")
    return Settings(**values)

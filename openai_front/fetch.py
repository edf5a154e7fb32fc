"""Fetching an allowlisted image URL (chat.check_remote_url ran first) without
letting the front reach what its clients cannot: every address a name
resolves to is checked after DNS (chat.address_allowed), and the connection
goes to an address that was checked (the resolver hands aiohttp only those),
so a name whose DNS points, or is rebound, to 127.0.0.1, 10/8 or
169.254.169.254 is refused. IP literals never reach a resolver: chat checks
them. Redirects are not followed: they could lead off the allowlist."""

import asyncio

import aiohttp
from aiohttp.abc import AbstractResolver

from .chat import address_allowed
from .errors import FrontError, invalid, too_large


class NonPublicAddress(OSError):
    """The name resolves only to addresses the front must not connect to."""


class PublicOnlyResolver(AbstractResolver):
    def __init__(self, allow_private=False, resolver=None):
        self.allow_private = allow_private
        self._resolver = resolver or aiohttp.ThreadedResolver()

    async def resolve(self, host, port=0, family=0):
        addresses = await self._resolver.resolve(host, port, family)
        allowed = [a for a in addresses if address_allowed(a["host"], self.allow_private)]
        if not allowed:
            raise NonPublicAddress(f"{host} resolves to no public address")
        return allowed

    async def close(self):
        await self._resolver.close()


def session(timeout_s, allow_private=False):
    """The client session for image URLs (create it in the running loop)."""
    connector = aiohttp.TCPConnector(resolver=PublicOnlyResolver(allow_private))
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s))


async def fetch_image(session, url, limit):
    """The URL's bytes, at most `limit` (413 past it); a failure is that request's 400."""
    try:
        async with session.get(url, allow_redirects=False) as response:
            if response.status != 200:
                raise invalid(f"fetching the image URL answered HTTP {response.status}")
            data = bytearray()
            # read(n) returns what has arrived, up to n bytes: loop to the end or past the limit.
            while len(data) <= limit:
                chunk = await response.content.read(limit + 1 - len(data))
                if not chunk:
                    break
                data += chunk
    except aiohttp.ClientError as error:
        if isinstance(error.__cause__, NonPublicAddress) or isinstance(getattr(error, "os_error", None),
                                                                        NonPublicAddress):
            raise FrontError(400, "the image URL is refused: its host resolves to a loopback, private or "
                                  "otherwise non-public address", code="image_url_not_allowed") from None
        raise invalid(f"fetching the image URL failed ({type(error).__name__})") from None
    except ValueError:  # yarl refusing the URL (a lone surrogate in its path, say)
        raise invalid("the image URL is malformed") from None
    except asyncio.TimeoutError as error:
        raise invalid(f"fetching the image URL failed ({type(error).__name__})") from None
    if len(data) > limit:
        raise too_large(f"the image at the URL is more than the {limit} bytes allowed")
    return bytes(data)

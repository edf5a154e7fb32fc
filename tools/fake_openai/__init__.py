"""Fake OpenAI-compatible upstream for tests and benchmarks; see server.py.

Standalone:  python -m tools.fake_openai --port 9100 --latency-ms 1000
In-process:  fake = FakeOpenAI(port=0); await fake.start(); fake.base_url
"""

from .server import MODES, FakeOpenAI, ThreadedFakeOpenAI, main

__all__ = ["FakeOpenAI", "MODES", "ThreadedFakeOpenAI", "main"]

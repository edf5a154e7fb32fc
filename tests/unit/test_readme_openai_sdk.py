"""README "Under overload": the openai SDK's settings for the front, run as
written against a stand-in front that refuses three times before it answers
(the SDK's default max_retries=2 would give up after the third refusal)."""

import asyncio
import pathlib
import re

from stand_in_http import StandInHandler, serving_http

ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "classify_and_describe",
          "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "a cup"}}]}


def test_the_readmes_sdk_settings_outlast_three_refusals(monkeypatch):
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    snippet = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S)
                   if "DefaultAioHttpClient" in block)
    attempts = []

    class RefusesThrice(StandInHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            attempts.append(self.path)
            if len(attempts) <= 3:  # as the front sheds; a short Retry-After keeps the test fast
                self.answer(503, {"error": {"message": "busy", "code": "service_unavailable"}},
                            [("Retry-After", "0.01")])
            else:
                self.answer(200, ANSWER)

    with serving_http(RefusesThrice) as address:
        monkeypatch.setenv("OPENAI_BASE_URL", f"http://{address}/v1")
        monkeypatch.setenv("OPENAI_API_KEY", "sk-stand-in")
        namespace = {}
        exec(snippet, namespace)  # noqa: S102 - our own README

        async def main():
            try:
                return await namespace["describe"]([{"role": "user", "content": "What is it?"}])
            finally:
                await namespace["client"].close()

        completion = asyncio.run(main())
    assert completion.choices[0].message.content == "a cup"
    assert attempts == ["/v1/chat/completions"] * 4

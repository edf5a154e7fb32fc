"""Python client for the `classify_and_describe` Triton ensemble.

    from classify_describe import Client
    result = Client("127.0.0.1:8000").infer(open("cat.jpg", "rb").read(),
                                             prompt="What breed is it?")
    print(result.labels[0], result.scores[0], result.description)

Many photos, N in flight, each file read only as its request is sent:

    async with AsyncClient("127.0.0.1:8000", concurrency=16, retries=2) as client:
        async for index, outcome in client.infer_many(paths):
            ...  # a Result, or that image's TritonRequestError (see .retryable)
"""

from classify_describe.client import AsyncClient, Client, Result, StreamEvent, Throttled, TritonRequestError

__all__ = ["AsyncClient", "Client", "Result", "StreamEvent", "Throttled", "TritonRequestError"]

"""Python client for the `classify_and_describe` Triton ensemble.

    from classify_describe import Client
    result = Client("127.0.0.1:8000").infer(open("cat.jpg", "rb").read(),
                                             prompt="What breed is it?")
    print(result.labels[0], result.scores[0], result.description)
"""

from classify_describe.client import AsyncClient, Client, Result, TritonRequestError

__all__ = ["AsyncClient", "Client", "Result", "TritonRequestError"]

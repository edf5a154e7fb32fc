"""Why a function is left out of the mutation run, and why a mutant that
survives is acceptable. Keys are mutmut's names (`mutmut show NAME` prints the
mutation); tools/mutation/run.py fails on a survivor that is missing here."""

_BACKOFF = ("the client's retry and back-off, being rewritten (Retry-After with jitter) in another change; "
            "mutate it again once that lands")
EXCLUDED = {
    "classify_describe.client.x_backoff_s": _BACKOFF,
    "classify_describe.client.x__check_retries": _BACKOFF,
    "classify_describe.client.x__resend": _BACKOFF,
    "classify_describe.client.x\u01c1Client\u01c1infer": _BACKOFF,
    "classify_describe.client.x\u01c1AsyncClient\u01c1infer": _BACKOFF,
}

EQUIVALENT = {
}

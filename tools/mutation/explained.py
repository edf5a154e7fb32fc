"""Why a function is left out of the mutation run, and why a mutant that
survives is acceptable. Keys are mutmut's names (`mutmut show NAME` in
build/mutants/run/stage prints the mutation; docs/mutation.md shows each);
tools/mutation/run.py fails on a survivor that is missing here."""

_BACKOFF = ("the client's retry and back-off, being rewritten (Retry-After with jitter) in another change; "
            "mutate it again once that lands")
EXCLUDED = {
    "classify_describe.client.x_backoff_s": _BACKOFF,
    "classify_describe.client.x__check_retries": _BACKOFF,
    "classify_describe.client.x__resend": _BACKOFF,
    "classify_describe.client.x\u01c1Client\u01c1infer": _BACKOFF,
    "classify_describe.client.x\u01c1AsyncClient\u01c1infer": _BACKOFF,
}

_GENERATION = ("Equivalent: the generation only has to differ from every earlier one so that old tickets are "
               "ignored; counting down or in twos does that as well as counting up in ones.")
_PROBE_FLAG = "Equivalent: the flag is only ever read as `not self._probe_in_flight`, where None and False agree."
_RESOLVER_DEFAULT = ("Equivalent: aiohttp's connector always passes host, port and family to a resolver; the "
                     "defaults only keep the AbstractResolver signature.")
_OVERREAD = ("Harmless: each read may ask for more than one byte past the limit, so at most about twice the "
             "limit is held before the loop stops, and the answer is the same 413.")
_VALUE_ERROR = ("Unreachable with the pinned aiohttp (3.14): every URL yarl refuses arrives as InvalidURL, "
                "a ClientError too, so the ClientError branch answers first (400 'fetching the image URL failed "
                "(InvalidUrlClientError)'); the branch stays for older aiohttp releases.")

_BOTH_CAUSES = ("Equivalent with the pinned aiohttp (3.14): a resolver's OSError is both the ClientConnectorError's "
                "os_error and its __cause__; the `or` keeps releases that set only one of them refusing.")

_SPLIT = "Equivalent: only the part before the first '%' is kept ([0]), however many splits are made."
_NOT_GLOBAL = ("Equivalent: Python counts every loopback, link-local, private and unspecified address as not "
               "is_global, which the same line requires, so how these four are combined cannot change the answer.")

_KEY_FILE = ("Equivalent here: without encoding=, open() uses the locale's, UTF-8 on this machine and in the image "
             "(Python's UTF-8 mode under the C locale), and API keys are ASCII; utf-8 stays so no locale can differ.")

_CODEC = "Equivalent: codec names are case-insensitive ('UTF-8' is 'utf-8')."
_FALSY = "Equivalent: the value is only read as a truth value, where None and False agree."

_FRESH_BREAKER = ("Equivalent: a fresh breaker's starting values are never read before they are set again: tickets "
                  "only have to match the current generation, _opened_at is set when the circuit opens, and the "
                  "probe flag is reset by the failure that opens it.")

_NONE_IS_ABSENT = ("Equivalent: the next lines read None as absent (false), as OpenAI reads a null field, so a "
                   "default of None or no default gives the same request.")

_CONN_LIMIT = ("Equivalent in what a caller sees: the semaphore of `concurrency` already holds requests in flight "
               "to that number, so aiohttp's own connection cap (100 without conn_limit) is never reached first.")

_RATE_KEY = ("Equivalent: the string is only the key that rate-limits this one warning; any key distinct from "
             "the failure reasons does.")
_CACHE_PREFIX = "Equivalent: the prefix only has to be the same for every key; the digest after it tells photos apart."
_SDK_TIMEOUT = ("Harmless: the attempt is bounded by Call.wait(..., timeout) as well; the SDK's own timeout only "
                "closes the connection a little sooner.")

_SIGNATURE = ("Checked by test_the_documented_defaults through the signature, which mutmut's trampoline keeps as "
              "the original's; only a call without arguments could tell, and that needs a server on 127.0.0.1:8000.")
_AIO_EMPTY_FINAL = ("Equivalent with the pinned tritonclient (2.51): its asyncio stream_infer does not pass "
                    "enable_empty_final_response on (test_the_async_grpc_stream_does_the_same shows it arrives unset).")

EQUIVALENT = {
    "classify_describe.client.x\u01c1Client\u01c1__init____mutmut_16": _FALSY,
    "classify_describe.client.x\u01c1Client\u01c1_http_stream__mutmut_39": _CODEC,
    "classify_describe.client.x\u01c1AsyncClient\u01c1_http_stream__mutmut_24": _CODEC,
    "classify_describe.client.x\u01c1AsyncClient\u01c1__init____mutmut_1": _SIGNATURE,
    "classify_describe.client.x\u01c1AsyncClient\u01c1__init____mutmut_4": _SIGNATURE,
    "classify_describe.client.x\u01c1AsyncClient\u01c1__init____mutmut_5": _SIGNATURE,
    "classify_describe.client.x\u01c1AsyncClient\u01c1__init____mutmut_6": _SIGNATURE,
    "classify_describe.client.x\u01c1AsyncClient\u01c1__init____mutmut_7": _SIGNATURE,
    "classify_describe.client.x\u01c1AsyncClient\u01c1_grpc_stream__mutmut_14": _AIO_EMPTY_FINAL,
    "classify_describe.client.x\u01c1AsyncClient\u01c1_grpc_stream__mutmut_15": _AIO_EMPTY_FINAL,
    "classify_describe.client.x\u01c1AsyncClient\u01c1_grpc_stream__mutmut_16": _AIO_EMPTY_FINAL,

    "classify_describe_server.describer.x\u01c1Describer\u01c1_remember_image_refusal__mutmut_3": _RATE_KEY,
    "classify_describe_server.describer.x\u01c1Describer\u01c1_remember_image_refusal__mutmut_7": _RATE_KEY,
    "classify_describe_server.describer.x\u01c1Describer\u01c1_remember_image_refusal__mutmut_8": _RATE_KEY,
    "classify_describe_server.describer.x\u01c1Job\u01c1cache_key__mutmut_6": _CACHE_PREFIX,
    "classify_describe_server.describer.x\u01c1Job\u01c1cache_key__mutmut_7": _CACHE_PREFIX,
    "classify_describe_server.describer.x\u01c1WholeAnswer\u01c1attempt__mutmut_13": _SDK_TIMEOUT,
    "classify_describe_server.describer.x\u01c1WholeAnswer\u01c1attempt__mutmut_17": _SDK_TIMEOUT,
    "classify_describe_server.describer.x\u01c1WholeAnswer\u01c1attempt__mutmut_18": _SDK_TIMEOUT,
    "classify_describe_server.describer.x\u01c1WholeAnswer\u01c1attempt__mutmut_25": ("Equivalent: the SDK's ChatCompletion always has a usage "
                                                            "attribute (None when the upstream sent none)."),
    "classify_describe_server.describer.x\u01c1Describer\u01c1_refused_image__mutmut_5": ("Harmless: differs only at the one instant the "
                                                                "refusal memory ends, which a float clock does not hit."),
    "classify_describe_server.describer.x\u01c1Describer\u01c1_sleep__mutmut_4": ("Harmless: at most one more zero-length sleep and "
                                                        "cancellation check when the back-off ends exactly."),
    "classify_describe.client.x\u01c1AsyncClient\u01c1__init____mutmut_38": _CONN_LIMIT,
    "classify_describe.client.x\u01c1AsyncClient\u01c1__init____mutmut_41": _CONN_LIMIT,
    "openai_front.chat.x_parse__mutmut_41": _NONE_IS_ABSENT,
    "openai_front.chat.x_parse__mutmut_43": _NONE_IS_ABSENT,
    "openai_front.chat.x_parse__mutmut_95": _NONE_IS_ABSENT,
    "openai_front.chat.x_parse__mutmut_97": _NONE_IS_ABSENT,
    "classify_describe_server.prompting.x__article__mutmut_9": ("Equivalent: the first letter is lowered before the test, so it is never one of "
                                       "the added capital X's; an empty noun is in any string either way."),
    "classify_describe_server.accounting.x_tokens_from__mutmut_8": "Equivalent: a missing prompt_tokens gives None, and `None or 0` is 0.",
    "classify_describe_server.resilience.x\u01c1CircuitBreaker\u01c1__init____mutmut_9": _FRESH_BREAKER,
    "classify_describe_server.resilience.x\u01c1CircuitBreaker\u01c1__init____mutmut_12": _FRESH_BREAKER,
    "classify_describe_server.resilience.x\u01c1CircuitBreaker\u01c1__init____mutmut_13": _FRESH_BREAKER,
    "classify_describe_server.resilience.x\u01c1CircuitBreaker\u01c1__init____mutmut_14": _FRESH_BREAKER,
    "classify_describe_server.resilience.x\u01c1CircuitBreaker\u01c1__init____mutmut_15": _FRESH_BREAKER,
    "classify_describe_server.resilience.x\u01c1CircuitBreaker\u01c1record_success__mutmut_4": _PROBE_FLAG,
    "classify_describe_server.resilience.x\u01c1CircuitBreaker\u01c1record_success__mutmut_5": (
        "Equivalent: after a success the circuit is closed, where the probe flag is not read, and the failure "
        "that opens it again resets the flag before any probe."),
    "classify_describe.client.x__generate_body__mutmut_13": _CODEC,
    "classify_describe.client.x\u01c1_StreamState\u01c1events__mutmut_76": (
        "Harmless: a stream's latency_ms off by 0.1 % (x 1001 instead of 1000); a test checks it is milliseconds, "
        "and no test can tell 0.1 % from a busy machine."),
    "openai_front.chat.x__valid_text__mutmut_3": _CODEC,
    "openai_front.chat.x__response_format__mutmut_66": _CODEC,
    "openai_front.chat.x__response_format__mutmut_60": _FALSY + " (json.dumps's ensure_ascii)",
    "openai_front.chat.x__sampling__mutmut_12": _FALSY,
    "classify_describe_server.settings.x\u01c1Settings\u01c1load_api_key__mutmut_2": _KEY_FILE,
    "classify_describe_server.settings.x\u01c1Settings\u01c1load_api_key__mutmut_4": _KEY_FILE,
    "openai_front.chat.x_address_allowed__mutmut_8": _SPLIT,
    "openai_front.chat.x_address_allowed__mutmut_11": _SPLIT,
    "openai_front.chat.x_address_allowed__mutmut_19": _NOT_GLOBAL,
    "openai_front.chat.x_address_allowed__mutmut_20": _NOT_GLOBAL,
    "openai_front.chat.x_address_allowed__mutmut_21": _NOT_GLOBAL,
    "openai_front.fetch.x_fetch_image__mutmut_2": ("Equivalent: aiohttp reads allow_redirects as a truth value, so None "
                                                  "does not follow redirects either (a test checks a 302 is not followed)."),
    "openai_front.fetch.x_fetch_image__mutmut_20": _BOTH_CAUSES,
    "classify_describe_server.resilience.x\u01c1CircuitBreaker\u01c1_set__mutmut_4": _GENERATION,
    "classify_describe_server.resilience.x\u01c1CircuitBreaker\u01c1_set__mutmut_5": _GENERATION,
    "classify_describe_server.resilience.x\u01c1CircuitBreaker\u01c1release__mutmut_2": _PROBE_FLAG,
    "classify_describe_server.resilience.x\u01c1CircuitBreaker\u01c1record_failure__mutmut_5": _PROBE_FLAG,
    "classify_describe_server.prompting.x__utf8__mutmut_6": _CODEC,
    "classify_describe_server.accounting.x_tokens_from__mutmut_20": "Equivalent: a missing completion_tokens gives None, and `None or 0` is 0.",
    "openai_front.fetch.x\u01c1PublicOnlyResolver\u01c1resolve__mutmut_1": _RESOLVER_DEFAULT,
    "openai_front.fetch.x\u01c1PublicOnlyResolver\u01c1resolve__mutmut_2": _RESOLVER_DEFAULT,
    "openai_front.fetch.x_fetch_image__mutmut_13": _OVERREAD,
    "openai_front.fetch.x_fetch_image__mutmut_15": _OVERREAD,
    "openai_front.fetch.x_fetch_image__mutmut_37": _VALUE_ERROR,
    "openai_front.fetch.x_fetch_image__mutmut_38": _VALUE_ERROR,
    "openai_front.fetch.x_fetch_image__mutmut_39": _VALUE_ERROR,
    "openai_front.fetch.x_fetch_image__mutmut_40": _VALUE_ERROR,
}

# Killed by tests written after the run that found them, not yet confirmed by a
# run of make mutants: each was applied with `mutmut apply` in that run's stage
# and the named test file failed on it.
_DESCRIBER_EDGES = ("Killed by tests/unit/test_describe_describer_edges.py, written after the describer run was "
                    "stopped (checked with `mutmut apply` in its stage; not yet in a make mutants run).")
KILLED_AFTER = {
    "classify_describe_server.describer.x__answer_text__mutmut_10": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x__answer_text__mutmut_11": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x__answer_text__mutmut_3": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x__answer_text__mutmut_4": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x__answer_text__mutmut_5": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x__answer_text__mutmut_9": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x__caused_by__mutmut_10": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x__caused_by__mutmut_4": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x__caused_by__mutmut_7": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x__caused_by__mutmut_8": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Describer\u01c1_warn_rate_limited__mutmut_1": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Describer\u01c1_warn_rate_limited__mutmut_10": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Describer\u01c1_warn_rate_limited__mutmut_3": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Describer\u01c1_warn_rate_limited__mutmut_4": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Describer\u01c1_warn_rate_limited__mutmut_5": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Describer\u01c1_warn_rate_limited__mutmut_9": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Describer\u01c1classify_failure__mutmut_15": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Describer\u01c1classify_failure__mutmut_16": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Describer\u01c1classify_failure__mutmut_19": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Describer\u01c1classify_failure__mutmut_21": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Describer\u01c1classify_failure__mutmut_58": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Describer\u01c1classify_failure__mutmut_62": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Describer\u01c1classify_failure__mutmut_8": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Describer\u01c1classify_failure__mutmut_9": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Job\u01c1cache_key__mutmut_11": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Job\u01c1cache_key__mutmut_12": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Job\u01c1cache_key__mutmut_16": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1Job\u01c1cache_key__mutmut_17": _DESCRIBER_EDGES,
    "classify_describe_server.describer.x\u01c1WholeAnswer\u01c1read__mutmut_2": _DESCRIBER_EDGES,
}

# Survivors neither killed nor shown harmless yet: the run fails on them.
_OPEN_ERROR_SOURCE = ("Open: with on_failure=error (or a JSON response_format) the error result's source is "
                      "only read for USAGE.vision, which an error answer does not send; a test through the adapter "
                      "would have to look at the metrics.")
_OPEN_STALL = ("Open: a stream whose server stops answering; the stand-ins answer at once, so no test waits on "
               "timeout_s yet.")
_OPEN_CANCEL = "Open: the server-side cancellation when a caller leaves a gRPC stream early; the stand-in does not see it."
_OPEN_HEADER = ("Open: the stand-in does not look at Content-Type; whether Triton's generate_stream needs it is "
                "for an integration test.")
_OPEN_IPV6 = "Open: only an IPv6 URL ([::1]:8000) tells partition from rpartition; no test streams over IPv6."
_OPEN_WINDOW = ("Open: infer_many would draw more images than the window from the iterable (the semaphore still caps "
                "requests); a test counting draws would kill it.")
OPEN = {
    "classify_describe.client.x\u01c1Client\u01c1_grpc_stream__mutmut_10": _OPEN_STALL,
    "classify_describe.client.x\u01c1Client\u01c1_grpc_stream__mutmut_12": _OPEN_STALL,
    "classify_describe.client.x\u01c1Client\u01c1_grpc_stream__mutmut_26": _OPEN_STALL,
    "classify_describe.client.x\u01c1Client\u01c1_grpc_stream__mutmut_30": _OPEN_STALL,
    "classify_describe.client.x\u01c1AsyncClient\u01c1_grpc_stream__mutmut_19": _OPEN_STALL,
    "classify_describe.client.x\u01c1AsyncClient\u01c1_grpc_stream__mutmut_21": _OPEN_STALL,
    "classify_describe.client.x\u01c1AsyncClient\u01c1_grpc_stream__mutmut_25": _OPEN_STALL,
    "classify_describe.client.x\u01c1Client\u01c1_http_stream__mutmut_8": _OPEN_STALL,
    "classify_describe.client.x\u01c1Client\u01c1_http_stream__mutmut_11": _OPEN_STALL,
    "classify_describe.client.x\u01c1AsyncClient\u01c1_http_stream__mutmut_1": _OPEN_STALL,
    "classify_describe.client.x\u01c1AsyncClient\u01c1_http_stream__mutmut_2": _OPEN_STALL,
    "classify_describe.client.x\u01c1Client\u01c1_grpc_stream__mutmut_38": _OPEN_CANCEL,
    "classify_describe.client.x\u01c1Client\u01c1_grpc_stream__mutmut_39": _OPEN_CANCEL,
    "classify_describe.client.x\u01c1Client\u01c1_http_stream__mutmut_20": _OPEN_HEADER,
    "classify_describe.client.x\u01c1Client\u01c1_http_stream__mutmut_29": _OPEN_HEADER,
    "classify_describe.client.x\u01c1Client\u01c1_http_stream__mutmut_30": _OPEN_HEADER,
    "classify_describe.client.x\u01c1Client\u01c1_http_stream__mutmut_31": _OPEN_HEADER,
    "classify_describe.client.x\u01c1Client\u01c1_http_stream__mutmut_32": _OPEN_HEADER,
    "classify_describe.client.x\u01c1Client\u01c1_http_stream__mutmut_33": _OPEN_HEADER,
    "classify_describe.client.x\u01c1AsyncClient\u01c1_http_stream__mutmut_5": _OPEN_HEADER,
    "classify_describe.client.x\u01c1AsyncClient\u01c1_http_stream__mutmut_8": _OPEN_HEADER,
    "classify_describe.client.x\u01c1AsyncClient\u01c1_http_stream__mutmut_15": _OPEN_HEADER,
    "classify_describe.client.x\u01c1AsyncClient\u01c1_http_stream__mutmut_16": _OPEN_HEADER,
    "classify_describe.client.x\u01c1AsyncClient\u01c1_http_stream__mutmut_17": _OPEN_HEADER,
    "classify_describe.client.x\u01c1AsyncClient\u01c1_http_stream__mutmut_18": _OPEN_HEADER,
    "classify_describe.client.x\u01c1AsyncClient\u01c1_http_stream__mutmut_19": _OPEN_HEADER,
    "classify_describe.client.x\u01c1Client\u01c1_http_stream__mutmut_3": _OPEN_IPV6,
    "classify_describe.client.x\u01c1AsyncClient\u01c1infer_many__mutmut_25": _OPEN_WINDOW,

    "classify_describe_server.describer.x\u01c1Describer\u01c1_bill__mutmut_17": ("Open: the price of a model listed in model_prices; a "
                                                         "describe() test with per-model prices would kill it."),
    "classify_describe_server.describer.x\u01c1Describer\u01c1_fallback__mutmut_17": _OPEN_ERROR_SOURCE,
    "classify_describe_server.describer.x\u01c1Describer\u01c1_fallback__mutmut_25": _OPEN_ERROR_SOURCE,
    "classify_describe_server.describer.x\u01c1Describer\u01c1_fallback__mutmut_26": _OPEN_ERROR_SOURCE,
}

# Printed under the runs in docs/mutation.md: what differs in the recorded runs
# from what tools/mutation/run.py does today.
RUN_NOTES = [
    "The full runs of the small modules, settings and chat started before the test selection was split by module "
    "and before the timed tests were left out: their mutants could run every unit test file of the three groups "
    "(mutmut still runs only those that reach the mutated function), and only test_both_sides_read_the_one_file "
    "and test_one_describer_holds_500_calls_in_flight (settings: all eight below) were left out.",
]

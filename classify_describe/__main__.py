"""Command line: classify and describe photos with one Triton request each.

    python -m classify_describe cat.jpg coffee.png --prompt "Is it safe to eat?"
    python -m classify_describe photos/*.jpg --concurrency 16 --json > results.jsonl
    python -m classify_describe cat.jpg --stream   # labels at once, then the text as it is written

Each file is read only when its request is sent. An image that fails (the
server refused it, no answer after the retries, a file that cannot be read) is
reported on its own, with its error and whether sending it again may succeed
("retryable"), and the other images go on.

Where Triton restricts inference to a key, the command sends the one in the
file named by TRITON_INFERENCE_KEY_FILE, else in TRITON_INFERENCE_KEY: the
names the server's supervisor reads its own from.

Exit status:
  0  every image was answered
  1  some images failed, each reported; the others were answered
  2  the command line is wrong
  3  no image got any answer, not even a refusal: the server is down or unreachable
"""

import argparse
import asyncio
import json
import os
import pathlib
import sys
import time

from classify_describe.client import AsyncClient, TritonRequestError

EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_NO_ANSWER = 0, 1, 2, 3  # EXIT_USAGE: argparse's


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m classify_describe", description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("Exit status"):],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("images", nargs="+", type=pathlib.Path, metavar="IMAGE")
    parser.add_argument("--prompt", help="a question about the image (default: describe it)")
    parser.add_argument("--url", help="server address (default 127.0.0.1:8000 for http, :8001 for grpc)")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--json", action="store_true", help="one JSON object per image on stdout "
                        "(with --stream: one per event)")
    parser.add_argument("--stream", action="store_true",
                        help="classify_and_describe_stream: print the labels at once and the description "
                             "as the LLM writes it (one image at a time)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--retries", type=int, default=2, metavar="N",
                        help="resend an image that got no answer or UNAVAILABLE up to N times, "
                             "never one that timed out (default 2)")
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if args.retries < 0:
        parser.error("--retries must be at least 0")
    args.url = args.url or ("127.0.0.1:8001" if args.protocol == "grpc" else "127.0.0.1:8000")
    try:
        args.inference_key = inference_key(os.environ)
    except (OSError, UnicodeDecodeError) as error:
        parser.error(f"TRITON_INFERENCE_KEY_FILE: cannot read it as text ({type(error).__name__})")
    return args


def inference_key(environ):
    """As the supervisor reads its own: the key in the file TRITON_INFERENCE_KEY_FILE names when
    that path exists, else TRITON_INFERENCE_KEY, else None."""
    path = environ.get("TRITON_INFERENCE_KEY_FILE")
    if path and pathlib.Path(path).exists():
        return pathlib.Path(path).read_text()  # the client strips its newline
    return environ.get("TRITON_INFERENCE_KEY") or None


def number(usage, key):
    """usage[key] when it is a number, else None: USAGE is the server's JSON, and a value of
    another type ("0.1") must not end the batch in a format string."""
    value = usage.get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def format_text(path, result):
    usage = result.usage
    lines = [f"{path}"]
    for label, score in zip(result.labels, result.scores):
        lines.append(f"  {score:6.1%}  {label}")
    lines.append(f"  description ({result.description_source}): {result.description}")
    if result.description_source == "fallback" and usage.get("fallback_reason"):
        lines.append(f"  fallback reason: {usage['fallback_reason']}")
    cost = number(usage, "cost_usd")
    lines.append(f"  tokens {usage.get('total_tokens', 0)}  cost "
                 f"{f'${cost:.6f}' if cost is not None else 'n/a'}  latency {result.latency_ms:.0f} ms")
    return "\n".join(lines)


class Progress:
    """A one-line progress bar on stderr, shown only for several images on a terminal."""

    def __init__(self, total):
        self.total, self.done, self.failed = total, 0, 0
        self.enabled = total > 1 and sys.stderr.isatty()
        self.started = time.perf_counter()

    def update(self, failed):
        self.done += 1
        self.failed += failed
        if self.enabled:
            width = 30
            filled = int(width * self.done / self.total)
            rate = self.done / max(time.perf_counter() - self.started, 1e-9)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
                             f"  {rate:.1f} img/s  failed {self.failed}")
            sys.stderr.flush()

    def clear(self):
        """Erase the bar before a line is printed; the next update redraws it."""
        if self.enabled:
            sys.stderr.write("\r\033[K")

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")


def print_event(path, event, as_json):
    if as_json:
        fields = {"labels": {"labels": event.labels, "scores": event.scores}, "text": {"text": event.text},
                  "done": {"result": event.result.as_dict() if event.result else None}}[event.kind]
        print(json.dumps({"image": str(path), "event": event.kind, **fields}), flush=True)
    elif event.kind == "labels":
        print(f"{path}")
        for label, score in zip(event.labels, event.scores):
            print(f"  {score:6.1%}  {label}")
        print("  description: ", end="", flush=True)
    elif event.kind == "text":
        print(event.text, end="", flush=True)
    else:
        result = event.result
        print()
        lines = [f"  source {result.description_source}"]
        if result.usage.get("fallback_reason"):
            lines.append(f"  reason: {result.usage['fallback_reason']}")
        first = number(result.usage, "time_to_first_token_ms")
        lines.append(f"  tokens {result.usage.get('total_tokens', 0)}  latency {result.latency_ms:.0f} ms"
                     + (f"  first token after {first:.0f} ms (server)" if first is not None else ""))
        print("\n".join(lines), flush=True)


async def run_stream(args):
    """One image at a time, each printed as its stream comes."""
    failures = unanswered = 0
    async with AsyncClient(args.url, args.protocol, timeout_s=args.timeout, inference_key=args.inference_key) as client:
        for path in args.images:
            try:
                image = path.read_bytes()
            except OSError as error:
                failures += 1
                print(f"{path}: error (not retryable): cannot read the file: {error.strerror or error}", file=sys.stderr)
                continue
            try:
                async for event in client.stream(image, args.prompt):
                    print_event(path, event, args.json)
            except Exception as error:  # noqa: BLE001 - this image failed, the next ones go on
                failures += 1
                answered = getattr(error, "answered", False)
                unanswered += not answered
                print(f"\n{path}: error: {error}", file=sys.stderr, flush=True)
    if not failures:
        return EXIT_OK
    return EXIT_NO_ANSWER if unanswered == len(args.images) else EXIT_SOME_FAILED


async def run(args):
    if args.stream:
        return await run_stream(args)
    progress = Progress(len(args.images))
    failures = unanswered = 0
    async with AsyncClient(args.url, args.protocol, concurrency=args.concurrency, timeout_s=args.timeout,
                           retries=args.retries, inference_key=args.inference_key) as client:
        # Paths, not bytes: infer_many reads each file as its request is sent.
        async for index, outcome in client.infer_many(args.images, args.prompt):
            path = args.images[index]
            failed = isinstance(outcome, TritonRequestError)
            progress.clear()
            if failed:
                failures += 1
                # Sent and never answered (an unreadable file was never sent).
                unanswered += outcome.retryable and not outcome.answered
                if args.json:
                    print(json.dumps({"image": str(path), "error": str(outcome),
                                      "retryable": outcome.retryable}), flush=True)
                else:
                    kind = "retryable" if outcome.retryable else "not retryable"
                    print(f"{path}: error ({kind}): {outcome}", file=sys.stderr, flush=True)
            elif args.json:
                print(json.dumps({"image": str(path), **outcome.as_dict()}), flush=True)
            else:
                print(format_text(path, outcome), flush=True)
            progress.update(failed)
    progress.close()
    if not failures:
        return EXIT_OK
    if unanswered == len(args.images):  # not one answer, not even a refusal
        print(f"no answer from Triton at {args.url} ({args.protocol}) for any image. "
              f"Is the server running (`make run`)? Is it ready "
              f"(curl http://<host>:8000/v2/health/ready)?", file=sys.stderr)
        return EXIT_NO_ANSWER
    return EXIT_SOME_FAILED


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())

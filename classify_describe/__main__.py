"""Command line: classify and describe photos with one Triton request each.

    python -m classify_describe cat.jpg coffee.png --prompt "Is it safe to eat?"
    python -m classify_describe photos/*.jpg --concurrency 16 --json > results.jsonl

Exit status: 0 when every image was answered, 1 when any request failed.
"""

import argparse
import asyncio
import json
import pathlib
import sys
import time

from classify_describe.client import AsyncClient, TritonRequestError


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m classify_describe", description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="+", type=pathlib.Path, metavar="IMAGE")
    parser.add_argument("--prompt", help="a question about the image (default: describe it)")
    parser.add_argument("--url", help="server address (default 127.0.0.1:8000 for http, :8001 for grpc)")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--json", action="store_true", help="one JSON object per image on stdout")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    args.url = args.url or ("127.0.0.1:8001" if args.protocol == "grpc" else "127.0.0.1:8000")
    return args


def format_text(path, result):
    usage = result.usage
    lines = [f"{path}"]
    for label, score in zip(result.labels, result.scores):
        lines.append(f"  {score:6.1%}  {label}")
    lines.append(f"  description ({result.description_source}): {result.description}")
    if result.description_source == "fallback" and usage.get("fallback_reason"):
        lines.append(f"  fallback reason: {usage['fallback_reason']}")
    cost = usage.get("cost_usd")
    lines.append(f"  tokens {usage.get('total_tokens', 0)}  cost "
                 f"{'$%.6f' % cost if cost is not None else 'n/a'}  latency {result.latency_ms:.0f} ms")
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

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")


async def run(args):
    images = []
    for path in args.images:
        try:
            images.append(path.read_bytes())
        except OSError as error:
            print(f"{path}: cannot read: {error.strerror}", file=sys.stderr)
            return 1
    progress = Progress(len(images))
    failures = 0
    async with AsyncClient(args.url, args.protocol, concurrency=args.concurrency,
                           timeout_s=args.timeout) as client:
        async for index, outcome in client.infer_many(images, args.prompt):
            path = args.images[index]
            failed = isinstance(outcome, TritonRequestError)
            failures += failed
            progress.update(failed)
            if failed:
                if args.json:
                    print(json.dumps({"image": str(path), "error": str(outcome)}), flush=True)
                else:
                    print(f"{path}: error: {outcome}", file=sys.stderr)
            elif args.json:
                print(json.dumps({"image": str(path), **outcome.as_dict()}), flush=True)
            else:
                if progress.enabled:
                    sys.stderr.write("\r\033[K")
                print(format_text(path, outcome), flush=True)
    progress.close()
    return 1 if failures else 0


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return asyncio.run(run(args))
    except (ConnectionError, OSError) as error:
        print(f"cannot reach Triton at {args.url} ({args.protocol}): {error}. "
              f"Is the server running (`make run`)? Is it ready "
              f"(curl http://<host>:8000/v2/health/ready)?", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

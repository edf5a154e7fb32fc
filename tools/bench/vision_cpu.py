"""CPU per classify_and_describe request with the describe step's vision on
(the default, auto) and off (LLM_VISION=off): what the view costs (issue 18,
target: on <= 1.1x off).

Two servers run side by side on free ports against one fake upstream, and the
turns alternate between them, so both see the same machine. Each request has
its own PROMPT (no answer from the in-model cache). CPU is read from /proc
(tools/bench/harness.cpu_seconds) around each turn.

    .venv/bin/python -m tools.bench.vision_cpu [--requests 200] [--turns 3] [--concurrency 4] [--results FILE]
"""

import argparse
import concurrent.futures
import io
import json
import pathlib
import statistics
import sys
import tempfile
import threading
import uuid

import numpy as np
import tritonclient.http as httpclient
from PIL import Image

from tools import host
from tools.bench.harness import cpu_seconds
from tools.local_stack import FakeLLM, TritonServer

SERVER = ("tritonserver", "preprocess stubs", "classifier stubs", "describe stubs")


def photos():
    """skimage's chelsea as a 640x427 and a 1600x1064 JPEG, and coffee as PNG: a mix of what clients send."""
    import skimage.data

    data_dir = pathlib.Path(skimage.data.__file__).parent
    chelsea = Image.open(data_dir / "chelsea.png").convert("RGB")
    out = []
    for size in ((640, 427), (1600, 1064)):
        buffer = io.BytesIO()
        chelsea.resize(size).save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    out.append((data_dir / "coffee.png").read_bytes())
    return out


def turn(server, llm, images, requests, concurrency):
    local = threading.local()  # a client per thread: tritonclient.http's (gevent) is not thread-safe

    def one(i):
        if not hasattr(local, "client"):
            local.client = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
        client = local.client
        image = httpclient.InferInput("IMAGE", [1, 1], "BYTES")
        image.set_data_from_numpy(np.array([[images[i % len(images)]]], dtype=np.object_))
        prompt = httpclient.InferInput("PROMPT", [1, 1], "BYTES")
        prompt.set_data_from_numpy(np.array([[f"Describe [{uuid.uuid4().hex}]".encode()]], dtype=np.object_))
        result = client.infer("classify_and_describe", [image, prompt])
        assert result.as_numpy("DESCRIPTION_SOURCE")[0][0] == b"llm"

    before = cpu_seconds(server.process.pid, llm.process.pid)
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(requests)))
    after = cpu_seconds(server.process.pid, llm.process.pid)
    spent = {k: (after.get(k, 0.0) - before.get(k, 0.0)) * 1000.0 / requests for k in after}
    spent["server"] = sum(spent.get(k, 0.0) for k in SERVER)
    return spent


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--results", type=pathlib.Path, help="also write the turns and the machine as JSON")
    args = parser.parse_args(argv)
    images = photos()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        llm = FakeLLM(tmp / "fake_llm.log")
        servers = {}
        try:
            for vision in ("off", "auto"):
                (tmp / vision).mkdir()
                servers[vision] = TritonServer(tmp / vision, {"LLM_BASE_URL": llm.base_url, "LLM_API_KEY": "sk-bench",
                                                              "LLM_VISION": vision})
                servers[vision].start()
            for server in servers.values():  # warm-up
                turn(server, llm, images, 20, args.concurrency)
            runs = {vision: [] for vision in servers}
            for _ in range(args.turns):
                for vision, server in servers.items():
                    runs[vision].append(turn(server, llm, images, args.requests, args.concurrency))
        finally:
            for server in servers.values():
                server.stop()
            llm.stop()
    machine = host.describe()
    print(f"ms of CPU per classify_and_describe request, median of {args.turns} turns of {args.requests} "
          f"(concurrency {args.concurrency}) on {host.summary(machine)}; {host.isa_text(machine)}\n")
    print("| where | vision off | vision auto (on) | on / off |\n| --- | --- | --- | --- |")
    for key in (*SERVER, "server", "fake upstream", "machine"):
        off = statistics.median(r.get(key, 0.0) for r in runs["off"])
        on = statistics.median(r.get(key, 0.0) for r in runs["auto"])
        print(f"| {key} | {off:.2f} | {on:.2f} | {on / off:.2f} |" if off else f"| {key} | {off:.2f} | {on:.2f} | - |")
    ratios = [a["server"] / o["server"] for a, o in zip(runs["auto"], runs["off"])]
    print(f"\nserver on/off per turn: {', '.join(f'{r:.3f}' for r in ratios)}")
    if args.results:
        args.results.write_text(json.dumps({"host": machine, "args": vars(args) | {"results": str(args.results)},
                                            "turns_ms_per_request": runs, "server_on_off_per_turn": ratios},
                                           indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""tools/bench/cpu_profile.py names each library perf reports by the step it does, and splits a
process's CPU by those shares; no server needed."""

from tools.bench import cpu_profile


def test_each_library_goes_to_its_step():
    cases = {
        "_imaging.cpython-311-x86_64-linux-gnu.so": "decode + resize (Pillow, libjpeg)",
        "libjpeg-8fa2e4c8.so.62.4.0": "decode + resize (Pillow, libjpeg)",
        "libonnxruntime.so.1.20.1": "forward (onnxruntime)",
        "libtritonserver-717102f0.so": "core: scheduler, ensemble, batcher",  # not the binary's row
        "tritonserver": "HTTP/gRPC front ends (tritonserver binary)",
        "libtriton_python.so": "Python backend: stub IPC, shared memory",
        "triton_python_backend_stub": "stub runtime: IPC, shared memory (stub binary)",
        "[kernel.kallsyms]": "kernel (syscalls, futex, copies)",
        "libc.so.6": "libc / libstdc++ (memcpy, malloc, semaphores)",
        "libpython3.11.so.1.0": "Python interpreter (our code, SDKs, asyncio, pb_utils)",
        "libsomething-else.so": "other libraries",
    }
    assert {dso: cpu_profile.dso_group(dso) for dso in cases} == cases


def test_the_table_splits_each_process_by_its_shares():
    turn = {"requests": 10, "throughput": 5.0, "p50_ms": 1.0,
            "cpu_ms_per_request": {"preprocess stubs": 3.0, "tritonserver": 1.0, "served (tritonserver + stubs)": 4.0}}
    results = {"args": {"rounds": 1, "seconds": 1.0, "concurrency": 1},
               "host": {"cpu": {"model": "X", "isa_flags": ["avx2"], "vnni": False}, "cores": 2, "memory_gib": 1,
                        "os": "Linux"},
               "inprocess": {"runtime": "onnx_fp32", "decode_ms": 1.0, "forward_ms": 2.0, "total_ms": 3.0},
               "models": {"classify": {"summary": cpu_profile.summarise([turn]),
                                       "profile": {"shares": {"preprocess stubs": {"decode + resize (Pillow, libjpeg)": 0.75,
                                                                                   "kernel (syscalls, futex, copies)": 0.25}}}}}}
    text = cpu_profile.markdown(results)
    assert "served / in-process 1.33" in text
    assert "| | decode + resize (Pillow, libjpeg) | 2.25 | 56% |" in text
    assert "| | kernel (syscalls, futex, copies) | 0.75 | 19% |" in text

"""The Triton-free logic of this project's backends and of the OpenAI-compatible front:
image decoding, the classifier runtimes, the describe step's LLM call, the error contract.

Each backends/<name>/model.py is a thin Triton adapter over these modules; only model.py
(and openai_describe's triton_io.py) import triton_python_backend_utils.
"""

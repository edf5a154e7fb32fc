"""An OpenAI-compatible HTTP front for the classify-and-describe pipeline:
POST /v1/chat/completions with an image part becomes one request to the
Triton ensemble over gRPC. Run it as `python -m openai_front`
(serving/supervise_tritonserver.sh starts it beside tritonserver)."""

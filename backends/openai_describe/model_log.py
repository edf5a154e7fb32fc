"""The server log as every backend of this project writes it: pb_utils.Logger
with "[<model name>] " in front, because the server log interleaves every model,
and "[request id: <id>] " after it on a line about one request, as Triton's own
messages name it (request_id.py). One file, linked from the other backends'
folders (as error_contract.py is)."""

import triton_python_backend_utils as pb_utils


class Log:
    def __init__(self, model_name):
        self.prefix = f"[{model_name}] "

    def info(self, message, request_id=None):
        pb_utils.Logger.log_info(self._line(message, request_id))

    def warn(self, message, request_id=None):
        pb_utils.Logger.log_warn(self._line(message, request_id))

    def error(self, message, request_id=None):
        pb_utils.Logger.log_error(self._line(message, request_id))

    def _line(self, message, request_id):
        # request_id: one that request_id.accept() let through (no space, bracket or newline).
        return self.prefix + (f"[request id: {request_id}] " if request_id else "") + message

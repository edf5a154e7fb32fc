"""The server log as every backend of this project writes it: "[<model name>] " in front,
because the server log interleaves every model, and "[request id: <id>] " after it on a line
about one request, as Triton's own messages name it (request_id.py). `logger` is
pb_utils.Logger, handed in by the backend's model.py, the one place that imports Triton."""


class Log:
    def __init__(self, model_name, logger):
        self.prefix = f"[{model_name}] "
        self._logger = logger

    def info(self, message, request_id=None):
        self._logger.log_info(self._line(message, request_id))

    def warn(self, message, request_id=None):
        self._logger.log_warn(self._line(message, request_id))

    def error(self, message, request_id=None):
        self._logger.log_error(self._line(message, request_id))

    def _line(self, message, request_id):
        # request_id: one that request_id.accept() let through (no space, bracket or newline).
        return self.prefix + (f"[request id: {request_id}] " if request_id else "") + message

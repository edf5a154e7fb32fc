"""The server log as every backend of this project writes it: pb_utils.Logger
with "[<model name>] " in front, because the server log interleaves every model.
One file, linked from the other backends' folders (as error_contract.py is)."""

import triton_python_backend_utils as pb_utils


class Log:
    def __init__(self, model_name):
        self.prefix = f"[{model_name}] "

    def info(self, message):
        pb_utils.Logger.log_info(self.prefix + message)

    def warn(self, message):
        pb_utils.Logger.log_warn(self.prefix + message)

    def error(self, message):
        pb_utils.Logger.log_error(self.prefix + message)

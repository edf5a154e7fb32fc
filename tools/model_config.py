"""Model configs as Triton reads them: config.pbtxt is protobuf text format for
Triton's ModelConfig (tritonclient ships the schema), so tools and tests parse
it with that schema, never with regexes."""

import pathlib

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2


def parse(text):
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def read(path):
    return parse(pathlib.Path(path).read_text())


def render(config):
    return text_format.MessageToString(config)

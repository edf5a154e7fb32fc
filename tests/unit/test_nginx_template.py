"""tools/nginx.py's rendering of deploy/nginx/triton-shed.conf.template, as the
official nginx image's envsubst does it. The proxy itself, running:
tests/integration/test_shedding_proxy.py."""

import pytest

from tools import nginx

VALUES = {"TRITON_HTTP_ADDR": "127.0.0.1:8000", "NGINX_LISTEN": "8080", "TRITON_MAX_IN_FLIGHT": 128}


def test_the_template_takes_the_three_documented_variables_and_keeps_nginxs_own():
    text = nginx.SHED_TEMPLATE.read_text()
    rendered = nginx.render(text, VALUES)
    assert "${" not in rendered
    assert "server 127.0.0.1:8000;" in rendered and "listen 8080;" in rendered
    assert "limit_conn triton_in_flight 128;" in rendered
    assert "limit_conn_zone $server_port" in rendered  # nginx's variable, left for nginx


def test_a_variable_without_a_value_is_an_error_not_an_empty_string():
    with pytest.raises(ValueError, match="TRITON_MAX_IN_FLIGHT"):
        nginx.render(nginx.SHED_TEMPLATE.read_text(), {k: v for k, v in VALUES.items() if k != "TRITON_MAX_IN_FLIGHT"})

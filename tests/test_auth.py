"""The status route answers only whom the webui's own API or UI would answer (--api-auth, --gradio-auth,
--gradio-auth-path), and its answer names no path of this machine."""
import base64
import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.doubles.fixtures import webui_factory  # noqa: F401
from webui_attn.ui import api, auth


def basic(user, password):
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def serve(webui_factory, mode, argv):
    """The webui started with ``argv``, its app given to the extension as the webui does at app start."""
    webui = webui_factory(mode, argv=argv)
    webui.load_scripts()
    from modules import script_callbacks
    app = FastAPI()
    app.tokens = {}  # gradio's App keeps its login tokens here
    script_callbacks.app_started_callback(None, app)
    return app, TestClient(app)


@pytest.mark.parametrize("mode", ["a1111", "neo"])
def test_open_when_the_webui_protects_nothing(webui_factory, mode):
    _, client = serve(webui_factory, mode, [])
    assert client.get(api.ROUTE).status_code == 200


@pytest.mark.parametrize("mode", ["a1111", "forge", "neo", "reforge", "classic"])
def test_api_auth_is_required_like_the_webuis_api(webui_factory, mode):
    _, client = serve(webui_factory, mode, ["--api-auth", "u:p:with:colons,other:x"])
    refused = client.get(api.ROUTE)
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Basic"
    assert client.get(api.ROUTE, headers=basic("u", "wrong")).status_code == 401
    assert client.get(api.ROUTE, headers=basic("nobody", "p:with:colons")).status_code == 401
    assert client.get(api.ROUTE, headers={"Authorization": "Basic !!!"}).status_code == 401
    assert client.get(api.ROUTE, headers=basic("u", "p:with:colons")).status_code == 200
    assert client.get(api.ROUTE, headers=basic("other", "x")).status_code == 200


def test_gradio_auth_accepts_the_ui_login_or_its_credentials(webui_factory):
    app, client = serve(webui_factory, "a1111", ["--gradio-auth", "g:q"])
    assert client.get(api.ROUTE).status_code == 401
    assert client.get(api.ROUTE, headers=basic("g", "q")).status_code == 200
    assert client.get(api.ROUTE, cookies={"access-token": "stale"}).status_code == 401
    app.tokens["tok-1"] = "g"                                   # what gradio's /login stores
    assert client.get(api.ROUTE, cookies={"access-token-unsecure": "tok-1"}).status_code == 200
    assert client.get(api.ROUTE, cookies={"access-token-abc123": "tok-1"}).status_code == 200  # gradio 4's name


def test_gradio_auth_file_counts_too(webui_factory, tmp_path):
    path = tmp_path / "auth.txt"
    path.write_text("a:1,b:2\nc:3\n", encoding="utf8")
    _, client = serve(webui_factory, "a1111", ["--gradio-auth-path", str(path)])
    assert client.get(api.ROUTE).status_code == 401
    assert all(client.get(api.ROUTE, headers=basic(u, p)).status_code == 200 for u, p in (("a", "1"), ("b", "2"), ("c", "3")))


def test_api_auth_wins_over_the_ui_login(webui_factory):
    app, client = serve(webui_factory, "a1111", ["--api-auth", "u:p", "--gradio-auth", "g:q"])
    app.tokens["tok"] = "g"
    assert client.get(api.ROUTE, headers=basic("g", "q")).status_code == 401
    assert client.get(api.ROUTE, cookies={"access-token": "tok"}).status_code == 401
    assert client.get(api.ROUTE, headers=basic("u", "p")).status_code == 200


def test_the_answer_names_no_path(webui_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("LIB_ATTN_CACHE_DIR", str(tmp_path / "cache-dir-of-this-user"))
    _, client = serve(webui_factory, "a1111", [])
    body = client.get(api.ROUTE).json()
    assert body["tuning"]["file"] == "tuning.json"
    assert "cache-dir-of-this-user" not in json.dumps(body)


def test_credentials_parse_as_the_webuis_do():
    assert auth.parse("u1:p1,u2:p:2, bad ,:nouser") == {"u1": "p1", "u2": "p:2"}
    assert auth.parse(None) == {}

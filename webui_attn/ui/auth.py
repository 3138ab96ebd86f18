"""The webui's own credentials, for the extension's route.

The status route tells what this machine is (processor, GPU, torch build, the last generation), so it
is protected as the webui protects itself:

* ``--api-auth u:p[,u2:p2]``: HTTP Basic with those credentials, as the webui's ``/sdapi`` routes;
* else ``--gradio-auth`` / ``--gradio-auth-path`` (the UI's login): HTTP Basic with the UI's
  credentials, or the login cookie of a UI session (gradio keeps its tokens in ``app.tokens``);
* neither: open, like the webui.

Credentials are read as the webuis read them: comma-separated ``user:password`` pairs, the password
being everything after the first ``:``; the auth file holds the same, on one or more lines.
"""
import secrets

REALM = {"WWW-Authenticate": "Basic"}


def parse(text) -> dict:
    """``"u1:p1,u2:p2"`` -> {"u1": "p1", "u2": "p2"}; entries without a ``:`` are ignored."""
    out = {}
    for entry in str(text or "").split(","):
        user, sep, password = entry.strip().partition(":")
        if sep and user:
            out[user] = password
    return out


def api_credentials(cmd_opts) -> dict:
    return parse(getattr(cmd_opts, "api_auth", None))


def ui_credentials(cmd_opts) -> dict:
    """The UI's login: ``--gradio-auth`` plus the lines of ``--gradio-auth-path``."""
    out = parse(getattr(cmd_opts, "gradio_auth", None))
    path = getattr(cmd_opts, "gradio_auth_path", None)
    if path:
        with open(path, encoding="utf8") as f:
            for line in f:
                out.update(parse(line))
    return out


def _basic_user(request, credentials: dict) -> str | None:
    """The user of a valid ``Authorization: Basic`` header, else None."""
    import base64
    import binascii

    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        user, _, password = base64.b64decode(value.strip()).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    expected = credentials.get(user)
    if expected is not None and secrets.compare_digest(password.encode(), expected.encode()):
        return user
    return None


def _session_user(request) -> str | None:
    """The user of a logged-in UI session: gradio sets an ``access-token…`` cookie at login (its name
    differs between gradio releases) and keeps the token in ``app.tokens``."""
    tokens = getattr(request.app, "tokens", None) or {}
    for name, value in request.cookies.items():
        if name.startswith("access-token") and value in tokens:
            return tokens[value]
    return None


def guard(cmd_opts):
    """A FastAPI dependency that refuses requests without the webui's credentials, or None when the
    webui protects nothing (``cmd_opts`` None: the running webui's flags)."""
    if cmd_opts is None:
        from modules import shared

        cmd_opts = shared.cmd_opts
    api, ui = api_credentials(cmd_opts), ui_credentials(cmd_opts)
    if not api and not ui:
        return None

    from fastapi import HTTPException, Request

    def check(request: Request):
        if api:
            if _basic_user(request, api) is None:
                raise HTTPException(status_code=401, detail="Incorrect username or password", headers=REALM)
            return
        if _basic_user(request, ui) is None and _session_user(request) is None:
            raise HTTPException(status_code=401, detail="Not authenticated", headers=REALM)

    return check


def dependencies(cmd_opts=None) -> list:
    """``dependencies=`` for ``add_api_route``: the guard, when the webui protects its API or UI."""
    from fastapi import Depends

    check = guard(cmd_opts)
    return [] if check is None else [Depends(check)]

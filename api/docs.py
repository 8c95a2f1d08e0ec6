"""The API's own document and docs page: /schema/openapi.json (built by `api.openapi`) and
Swagger UI at /schema, whose assets come from the `swagger_ui_bundle` package and this
package's `static/` folder, so the page loads with no network beyond this service."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from litestar import Response, get
from litestar.exceptions import NotFoundException

from api.openapi import document_json

__all__ = ["DOCS_HANDLERS", "PAGE"]

_BUNDLE = Path(str(importlib.resources.files("swagger_ui_bundle")))
_UI = next(_BUNDLE.glob("vendor/swagger-ui-*"))
_OWN = Path(__file__).parent / "static"
# Every asset the page may load, by name: nothing else is served from disk.
ASSETS: dict[str, tuple[Path, str]] = {
    "swagger-ui-bundle.js": (_UI / "swagger-ui-bundle.js", "text/javascript; charset=utf-8"),
    "swagger-ui.css": (_UI / "swagger-ui.css", "text/css; charset=utf-8"),
    "favicon-32x32.png": (_UI / "favicon-32x32.png", "image/png"),
    "tollgate-docs.js": (_OWN / "tollgate-docs.js", "text/javascript; charset=utf-8"),
}

PAGE = b"""<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>tollgate API</title>
  <link rel="icon" type="image/png" href="/schema/assets/favicon-32x32.png">
  <link rel="stylesheet" href="/schema/assets/swagger-ui.css">
  <style>
    body { margin: 0; }
    .tollgate-signing { font-family: sans-serif; margin: 1em 2em; padding: .6em 1em;
                        background: #f6f6f6; border-left: 4px solid #49cc90; }
  </style>
</head>
<body>
  <p class="tollgate-signing">To try a signed route: <b>Authorize</b>, enter <code>KEY_ID:SECRET</code>
    (from <code>tollgate keys create</code>) as the SVC-AUTH value; this page then signs each request
    here in the browser, and the secret is never sent. Signing needs this page on localhost,
    127.0.0.1 or https.</p>
  <div id="swagger-ui"></div>
  <script src="/schema/assets/swagger-ui-bundle.js"></script>
  <script src="/schema/assets/tollgate-docs.js"></script>
</body>
</html>
"""
_DOCUMENT = document_json()


@get(["/schema", "/schema/swagger"], include_in_schema=False, sync_to_thread=False)
def docs_page() -> Response[bytes]:
    return Response(PAGE, media_type="text/html; charset=utf-8")


@get("/schema/openapi.json", include_in_schema=False, sync_to_thread=False)
def openapi_json() -> Response[bytes]:
    return Response(_DOCUMENT, media_type="application/vnd.oai.openapi+json")


@get("/schema/assets/{name:str}", include_in_schema=False, sync_to_thread=False)
def asset(name: str) -> Response[bytes]:
    found = ASSETS.get(name)
    if found is None:
        raise NotFoundException(f"no asset {name!r}")
    path, media_type = found
    return Response(path.read_bytes(), media_type=media_type,
                    headers={"Cache-Control": "public, max-age=3600"})


DOCS_HANDLERS = [docs_page, openapi_json, asset]

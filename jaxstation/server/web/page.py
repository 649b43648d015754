"""The chat page: static HTML, CSS and JS shipped in the package and served at `/` and `/web/<file>`.

The page talks to the station only through the public API (`/v1/chat/completions`, `/v1/models`, `/tokenize`,
`/station/status`, `/ready`), so it needs nothing the API does not already offer. Its files (HTML, a style sheet and
ES modules, no build step) are read once, at import, and served with a Content-Security-Policy that allows scripts,
styles and connections to this origin only, and no inline script: model output rendered by the page cannot run code
even if the page's renderer had a bug.
"""

from __future__ import annotations

from importlib import resources

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8"}


def _load() -> dict[str, tuple[bytes, str]]:
    """Every file of static/, by name, with its media type."""
    files = resources.files("jaxstation.server.web").joinpath("static")
    return {f.name: (f.read_bytes(), MEDIA_TYPES[f.name[f.name.rfind("."):]])
            for f in files.iterdir() if f.name[f.name.rfind("."):] in MEDIA_TYPES}


FILES = _load()


def is_web_path(path: str) -> bool:
    """Whether `path` is the page or one of its files (served without the API key, like /health)."""
    return path == "/" or path.startswith("/web/")


def _file(name: str) -> Response:
    body, media_type = FILES[name]
    return Response(body, media_type=media_type, headers=HEADERS)


async def _index(request: Request) -> Response:
    return _file("index.html")


async def _asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in FILES:
        raise HTTPException(404)
    return _file(name)


def web_routes() -> list[Route]:
    """`GET /` (the page) and `GET /web/<file>` (its modules and style sheet)."""
    return [Route("/", _index, methods=["GET"]), Route("/web/{name}", _asset, methods=["GET"])]

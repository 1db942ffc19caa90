"""GET /: the page (a chat on sessions and a live view of the engine), served from files shipped in
the package (kvserve/server/static): no build step, nothing fetched from elsewhere. The page is code
only; everything it shows comes from the API with the caller's key, so it needs none itself."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

from kvserve.server.state import APIError

router = APIRouter()
STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css"}
# The page runs only its own files and talks only to this server; model text is set as text, never
# as markup, and the policy refuses inline scripts besides.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _file(name: str) -> Response:
    path = STATIC_DIR / name
    if name not in {p.name for p in STATIC_DIR.iterdir()} or path.suffix not in MEDIA_TYPES:
        raise APIError(404, f"No file {name!r}.", "not_found_error")
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=HEADERS)


@router.get("/", include_in_schema=False)
async def index() -> Response:
    return _file("index.html")


@router.get("/static/{name}", include_in_schema=False)
async def static(name: str) -> Response:
    return _file(name)

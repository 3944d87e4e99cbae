"""The built-in admin page (docs/admin-page.md): ``/admin/``, a static shell, and its files.

The files hold no data, so they are served without the admin key: a browser's navigation
cannot send a bearer token. The page's script asks the operator for the key, keeps it in
``sessionStorage`` and calls the admin JSON endpoints with it; every value it shows comes
from them. The headers keep the page to its own files (no inline script, nothing from
elsewhere), out of frames and out of caches.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

from .handler import Handler

# file → its content type; index.html is served as /admin/, the others under /admin/
FILES = {
    "index.html": "text/html",
    "admin.js": "text/javascript",
    "admin.css": "text/css",
    "favicon.svg": "image/svg+xml",
}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def add_routes(app: web.Application) -> None:
    """``GET /admin/`` and the page's files, read once here; ``/admin`` redirects to it."""
    folder = resources.files(__package__) / "admin_page"
    for name, content_type in FILES.items():
        path = "/admin/" if name == "index.html" else f"/admin/{name}"
        app.router.add_get(path, _serving((folder / name).read_bytes(), content_type))
    app.router.add_get("/admin", _to_page)


def _serving(body: bytes, content_type: str) -> Handler:
    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type, charset="utf-8", headers=HEADERS)

    return serve


async def _to_page(request: web.Request) -> web.Response:
    """A relative redirect, so that the page works behind a reverse proxy's path prefix."""
    return web.Response(status=308, headers={"Location": "admin/", **HEADERS})

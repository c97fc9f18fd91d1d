"""The shop as a Starlette application: HTML pages per session, state and expert endpoints.

Every episode URL is under ``/s/{sid}/`` (``sid``: 1-64 of ``[A-Za-z0-9_-]``, chosen by the
client; a session is created on first use and lives in memory). Pages work without JavaScript:
links and forms only. Each page view is a pure function of the session's state (a
:class:`Session`) and the catalogue, so that ``GET /s/{sid}/page`` after ``PUT /s/{sid}/state``
renders byte-identically to the page the state was exported on.

Routes (all GET unless marked):

* ``/`` a landing page for a person, ``/start[?goal=ID]`` a fresh session, ``/healthz``;
* ``/goals?split=train|test`` goal ids (JSON), ``/goal/{id}`` one goal (JSON);
* ``/s/{sid}/reset?goal=ID`` starts an episode (404 for an unknown goal) and redirects home;
* ``/s/{sid}/`` search home, ``/s/{sid}/search?q=&page=`` results, ``/s/{sid}/item/{pid}``
  (option choices as query parameters), ``.../description``, ``.../features``, POST
  ``.../buy``, ``/s/{sid}/done`` the thank-you page;
* ``/s/{sid}/page`` the session's current page, ``/s/{sid}/state`` (GET, PUT) its state as
  JSON, ``/s/{sid}/expert`` the expert's next action (JSON).
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

from jinja2 import Environment, PackageLoader
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse
from starlette.routing import Route

from bpo.web.catalog import Catalog, Product
from bpo.web.goals import PER_PAGE, SPLITS, Goal, expert_action, reward

PAGES = ("home", "results", "item", "description", "features", "done")
MAX_QUERY = 500
"""Characters of a search query kept (a longer one is cut, as a shop's search box would)."""
MAX_SESSIONS = 100_000
"""Sessions kept in memory; the least recently used beyond this are forgotten."""
MAX_BODY = 256 * 1024
_SID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NO_GOAL = "Browse the shop freely (no instruction: reset with a goal to get one)."


@dataclass
class Session:
    """One episode's state: everything a page render reads, and JSON-serialisable."""

    goal: str | None = None
    page: str = "home"
    query: str = ""
    """The last search, kept while on a product (its "< Prev" goes back to these results)."""
    page_no: int = 1
    product: str | None = None
    options: dict[str, str] = field(default_factory=dict)
    """Chosen option values of ``product``, group -> value, in the product's group order."""
    message: str = ""
    """A notice shown on the current page (e.g. options missing at "Buy Now")."""
    done: bool = False
    reward: float = 0.0
    bought: str | None = None
    bought_options: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any, catalog: Catalog, goals: dict[str, Goal]) -> Session:
        """A session from exported JSON (the ``url`` key is derived and ignored); ValueError
        saying what is wrong otherwise."""
        if not isinstance(data, dict):
            raise ValueError("the state must be a JSON object")
        known = {f for f in cls.__dataclass_fields__} | {"url"}
        if extra := sorted(set(data) - known):
            raise ValueError(f"unknown state keys {extra}; valid keys: {sorted(known)}")
        s = cls(**{k: v for k, v in data.items() if k != "url"})
        ok = (
            (s.goal is None or s.goal in goals) and s.page in PAGES
            and isinstance(s.query, str) and len(s.query) <= MAX_QUERY
            and type(s.page_no) is int and 1 <= s.page_no <= 1000
            and isinstance(s.message, str) and len(s.message) <= 1000
            and type(s.done) is bool and type(s.reward) in (int, float)
            and 0.0 <= s.reward <= 1.0
            and all(isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str)
                    for k, v in d.items()) for d in (s.options, s.bought_options))
        )  # fmt: skip
        for pid, chosen in ((s.product, s.options), (s.bought, s.bought_options)):
            product = catalog.product(pid) if ok and isinstance(pid, str) else None
            ok = ok and (pid is None or product is not None)
            ok = ok and chosen == (Shop.choices(product, chosen) if product else {})
        if s.page in ("item", "description", "features") and s.product is None:
            ok = False
        if not ok:
            raise ValueError("the state has a field of the wrong type, out of range, or naming "
                             "an unknown goal, page, product or option")  # fmt: skip
        s.reward = float(s.reward)
        return s

    def to_json(self, sid: str) -> dict[str, Any]:
        return {**asdict(self), "url": url_of(sid, self)}


def _path(sid: str, *parts: str, query: dict[str, Any] | None = None) -> str:
    url = f"/s/{sid}/" + "/".join(quote(p, safe="") for p in parts)
    encoded = urlencode([(k, v) for k, v in (query or {}).items() if v is not None])
    return f"{url}?{encoded}" if encoded else url


def url_of(sid: str, s: Session) -> str:
    """The canonical URL of the session's current page."""
    if s.done:
        return _path(sid, "done")
    if s.page == "results":
        return _path(sid, "search", query={"q": s.query, "page": s.page_no})
    if s.page == "item" and s.product:
        return _path(sid, "item", s.product, query=s.options)
    if s.page in ("description", "features") and s.product:
        return _path(sid, "item", s.product, s.page)
    return _path(sid)


class Shop:
    """The catalogue, the goals and the sessions; renders a session's page."""

    def __init__(self, catalog: Catalog, goals: dict[str, Goal]) -> None:
        self.catalog = catalog
        self.goals = goals
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.templates = Environment(
            loader=PackageLoader("bpo.web", "templates"), autoescape=True,
            trim_blocks=True, lstrip_blocks=True,
        )  # fmt: skip

    def session(self, sid: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            s = self.sessions[sid] = Session()
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        self.sessions.move_to_end(sid)
        return s

    def instruction(self, s: Session) -> str:
        return self.goals[s.goal].instruction if s.goal in self.goals else _NO_GOAL

    def html(self, template: str, s: Session, **context: Any) -> str:
        return self.templates.get_template(template).render(
            instruction=self.instruction(s), message=s.message, done=s.done, reward=s.reward,
            **context,
        )  # fmt: skip

    def results(self, query: str) -> tuple[str, ...]:
        return self.catalog.search(query)

    def render(self, sid: str, s: Session) -> str:
        """The session's current page (a pure function of ``s`` and the catalogue)."""
        home = _path(sid)
        if s.done:
            product = self.catalog.product(s.bought) if s.bought else None
            goal = self.goals.get(s.goal or "")
            parts = reward(goal, product, s.bought_options) if goal and product else None
            return self.html("done.html", s, title="Thank you", product=product,
                             chosen=list(s.bought_options.items()), parts=parts,
                             again_url=_path(sid, "reset", query={"goal": s.goal}))  # fmt: skip
        product = self.catalog.product(s.product) if s.product else None
        if s.page == "results":
            ids = self.results(s.query)
            n_pages = max(1, math.ceil(len(ids) / PER_PAGE))
            start = (s.page_no - 1) * PER_PAGE
            items = [self.catalog.product(pid) for pid in ids[start : start + PER_PAGE]]
            return self.html(
                "results.html", s, title=f"Results for {s.query}", home_url=home,
                query=s.query, page_no=s.page_no, n_pages=n_pages, n_results=len(ids),
                first=start + 1,
                items=[{"id": p.id, "title": p.title, "price": p.price,
                        "url": _path(sid, "item", p.id)} for p in items if p],
                prev_url=_path(sid, "search", query={"q": s.query, "page": s.page_no - 1}) if s.page_no > 1 else None,
                next_url=_path(sid, "search", query={"q": s.query, "page": s.page_no + 1}) if s.page_no < n_pages else None,
            )  # fmt: skip
        if product is not None and s.page == "item":
            return self.html("item.html", s, **self._item_context(sid, s, product))
        if product is not None and s.page in ("description", "features"):
            lines = [product.description] if s.page == "description" else list(product.features)
            return self.html(
                "detail.html", s, title=f"{s.page.capitalize()}: {product.title}", home_url=home,
                prev_url=_path(sid, "item", product.id, query=s.options), product=product,
                heading=s.page.capitalize(), lines=lines,
            )  # fmt: skip
        return self.html("home.html", s, title="Search", n_products=len(self.catalog),
                         search_url=_path(sid, "search"))  # fmt: skip

    def _item_context(self, sid: str, s: Session, product: Product) -> dict[str, Any]:
        groups = []
        for name, values in product.options:
            options = []
            for value in values:
                chosen = {**s.options, name: value}
                options.append({"value": value, "selected": s.options.get(name) == value,
                                "url": _path(sid, "item", product.id, query=chosen)})  # fmt: skip
            groups.append({"name": name, "options": options})
        back = (
            _path(sid, "search", query={"q": s.query, "page": s.page_no}) if s.query else _path(sid)
        )
        return dict(
            title=product.title, product=product, groups=groups, chosen=list(s.options.items()),
            home_url=_path(sid), prev_url=back, buy_url=_path(sid, "item", product.id, "buy"),
            description_url=_path(sid, "item", product.id, "description"),
            features_url=_path(sid, "item", product.id, "features"),
        )  # fmt: skip

    @staticmethod
    def choices(product: Product, fields: dict[str, str]) -> dict[str, str]:
        """The valid option choices among ``fields``, in the product's group order."""
        return {g: fields[g] for g, values in product.options if fields.get(g) in values}


# -- routes -----------------------------------------------------------------------------------------
def _shop(request: Request) -> Shop:
    return request.app.state.shop


def _sid(request: Request) -> str | None:
    sid = request.path_params.get("sid", "")
    return sid if _SID.fullmatch(sid) else None


def _page(request: Request, sid: str, s: Session, status: int = 200) -> HTMLResponse:
    return HTMLResponse(_shop(request).render(sid, s), status_code=status)


def _not_found(request: Request, detail: str) -> HTMLResponse:
    sid = _sid(request)
    if sid is None:
        return PlainTextResponse(f"Not found: {detail}\n", status_code=404)
    shop = _shop(request)
    s = shop.session(sid)
    html = shop.html("notfound.html", s, title="Not found", detail=detail, home_url=_path(sid))
    return HTMLResponse(html, status_code=404)


def _session_view(handler):
    """Checks the session name, finds (or creates) the session, and answers the thank-you page
    for any page of a finished episode."""

    async def view(request: Request):
        sid = _sid(request)
        if sid is None:
            return PlainTextResponse(
                "Not found: a session name is 1-64 letters, digits, '_' or '-'\n", status_code=404
            )
        s = _shop(request).session(sid)
        if s.done:
            return _page(request, sid, s)
        return await handler(request, sid, s)

    return view


@_session_view
async def home(request: Request, sid: str, s: Session):
    s.page, s.query, s.page_no, s.product, s.options, s.message = "home", "", 1, None, {}, ""
    return _page(request, sid, s)


@_session_view
async def search(request: Request, sid: str, s: Session):
    query = " ".join(request.query_params.get("q", "").split())[:MAX_QUERY]
    s.product, s.options = None, {}
    if not query:
        s.page, s.query, s.page_no = "home", "", 1
        s.message = "Please type what you are looking for."
        return _page(request, sid, s)
    n_pages = max(1, math.ceil(len(_shop(request).results(query)) / PER_PAGE))
    raw = request.query_params.get("page", "1")
    page_no = int(raw) if raw.isascii() and raw.isdigit() and len(raw) < 6 else 1
    s.page, s.query, s.page_no, s.message = "results", query, min(max(1, page_no), n_pages), ""
    return _page(request, sid, s)


@_session_view
async def item(request: Request, sid: str, s: Session):
    shop = _shop(request)
    product = shop.catalog.product(request.path_params["pid"])
    if product is None:
        return _not_found(request, "There is no product with that id.")
    view = request.path_params.get("view", "")
    if view not in ("", "description", "features"):
        return _not_found(request, "There is no such page for this product.")
    if view:
        s.options = s.options if s.product == product.id else {}
    else:
        s.options = shop.choices(product, dict(request.query_params))
    s.page, s.product, s.message = view or "item", product.id, ""
    return _page(request, sid, s)


@_session_view
async def buy(request: Request, sid: str, s: Session):
    shop = _shop(request)
    product = shop.catalog.product(request.path_params["pid"])
    if product is None:
        return _not_found(request, "There is no product with that id.")
    body = await _body(request)
    if body is None:
        return PlainTextResponse("Request body too large\n", status_code=413)
    fields = dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))
    chosen = shop.choices(product, fields)
    s.page, s.product, s.options = "item", product.id, chosen
    missing = [g for g, _ in product.options if g not in chosen]
    if missing:
        s.message = "Please select " + " and ".join(missing) + " before buying."
        return _page(request, sid, s)
    goal = shop.goals.get(s.goal or "")
    s.done, s.bought, s.bought_options, s.message = True, product.id, chosen, ""
    s.reward = reward(goal, product, chosen).reward if goal else 0.0
    s.page = "done"
    return RedirectResponse(_path(sid, "done"), status_code=303)


@_session_view
async def current_page(request: Request, sid: str, s: Session):
    return _page(request, sid, s)


@_session_view
async def unknown(request: Request, sid: str, s: Session):
    return _not_found(request, "There is no such page in the shop.")


async def reset(request: Request):
    sid = _sid(request)
    if sid is None:
        return PlainTextResponse("Not found: bad session name\n", status_code=404)
    shop = _shop(request)
    goal = request.query_params.get("goal") or None
    if goal is not None and goal not in shop.goals:
        return PlainTextResponse(f"Not found: no goal {goal[:100]!r}\n", status_code=404)
    shop.session(sid)
    shop.sessions[sid] = Session(goal=goal)
    return RedirectResponse(_path(sid), status_code=303)


async def state(request: Request):
    sid = _sid(request)
    if sid is None:
        return JSONResponse({"error": "bad session name"}, status_code=404)
    shop = _shop(request)
    if request.method == "GET":
        return JSONResponse(shop.session(sid).to_json(sid))
    body = await _body(request)
    if body is None:
        return JSONResponse({"error": "state too large"}, status_code=413)
    try:
        s = Session.from_json(json.loads(body), shop.catalog, shop.goals)
    except (ValueError, TypeError, RecursionError) as e:
        return JSONResponse({"error": f"bad state: {e}"}, status_code=400)
    shop.session(sid)
    shop.sessions[sid] = s
    return JSONResponse({"ok": True, "url": url_of(sid, s)})


async def expert(request: Request):
    sid = _sid(request)
    if sid is None:
        return JSONResponse({"error": "bad session name"}, status_code=404)
    shop = _shop(request)
    s = shop.session(sid)
    goal = shop.goals.get(s.goal or "")
    action = expert_action(goal, shop.catalog, s) if goal else None
    return JSONResponse({"action": action})


async def _body(request: Request) -> bytes | None:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def landing(request: Request):
    shop = _shop(request)
    train = [g for g in shop.goals.values() if g.split == "train"]
    html = shop.templates.get_template("landing.html").render(
        n_products=len(shop.catalog), n_train=len(train), n_test=len(shop.goals) - len(train),
        goals=train[:15],
    )  # fmt: skip
    return HTMLResponse(html)


async def start(request: Request):
    shop = _shop(request)
    goal = request.query_params.get("goal")
    if goal is None:
        goal = secrets.choice([g for g in shop.goals if g.startswith("shop-train-")])
    sid = "web-" + secrets.token_hex(8)
    return RedirectResponse(_path(sid, "reset", query={"goal": goal}), status_code=303)


async def healthz(request: Request):
    return PlainTextResponse("ok")


async def goal_ids(request: Request):
    split = request.query_params.get("split", "train")
    if split not in SPLITS:
        return JSONResponse({"error": f"split must be one of {list(SPLITS)}"}, status_code=400)
    return JSONResponse([g.id for g in _shop(request).goals.values() if g.split == split])


async def goal_info(request: Request):
    goal = _shop(request).goals.get(request.path_params["gid"])
    if goal is None:
        return JSONResponse({"error": "no such goal"}, status_code=404)
    return JSONResponse(goal.to_json())


def make_app(catalog: Catalog, goals: dict[str, Goal]) -> Starlette:
    """The shop's ASGI application over a catalogue and its goals."""
    routes = [
        Route("/", landing), Route("/start", start), Route("/healthz", healthz),
        Route("/goals", goal_ids), Route("/goal/{gid}", goal_info),
        Route("/s/{sid}/reset", reset), Route("/s/{sid}/state", state, methods=["GET", "PUT"]),
        Route("/s/{sid}/expert", expert), Route("/s/{sid}/page", current_page),
        Route("/s/{sid}/", home), Route("/s/{sid}/search", search),
        Route("/s/{sid}/done", current_page),
        Route("/s/{sid}/item/{pid}", item), Route("/s/{sid}/item/{pid}/buy", buy, methods=["POST"]),
        Route("/s/{sid}/item/{pid}/{view}", item),
        Route("/s/{sid}/{rest:path}", unknown),
    ]  # fmt: skip
    app = Starlette(routes=routes)
    app.state.shop = Shop(catalog, goals)
    return app

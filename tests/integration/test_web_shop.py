"""The local web shop (bpo.web) over real HTTP: a deterministic catalogue of 5,000 products,
BM25 search that ranks an exact title first, every page type, isolated sessions, state export
and import that re-render byte for byte, WebShop's reward on hand-computed cases, the expert
buying reward-1 products through the site, and a fuzz of malformed requests that never gets a
5xx."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import sqlite3
import subprocess
import sys
import time
from html.parser import HTMLParser
from urllib.parse import urljoin

import httpx
import pytest

from bpo.web.catalog import CATEGORIES, Catalog, Product, build, generate
from bpo.web.goals import Goal, make_goals, reward
from bpo.web.serve import start_server

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("web-cache")


@pytest.fixture(scope="module")
def catalog(cache):
    return Catalog.open(5000, 0, cache)


@pytest.fixture(scope="module")
def shop(cache, catalog):
    url, stop = start_server(products=5000, cache_dir=str(cache))
    yield url
    stop()


@pytest.fixture
def http(shop):
    with httpx.Client(base_url=shop, follow_redirects=True, timeout=30) as c:
        yield c


# -- a minimal agent-side reading of a page: links, form buttons, the search form -------------------
class _Page(HTMLParser):
    def __init__(self, url: str) -> None:
        super().__init__(convert_charrefs=True)
        self.url = url
        self.clicks: dict[str, tuple[str, str, dict[str, str]]] = {}
        self.texts: list[str] = []
        self.search: tuple[str, str] | None = None
        self.meta: dict[str, str] = {}
        self._a: tuple[str, list[str]] | None = None
        self._button: list[str] | None = None
        self._form: tuple[str, str, dict[str, str]] | None = None

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        if tag == "meta" and "name" in a:
            self.meta[a["name"]] = a.get("content", "")
        elif tag == "a" and "href" in a:
            self._a = (urljoin(self.url, a["href"]), [])
        elif tag == "form":
            self._form = (a.get("method", "get").lower(), urljoin(self.url, a["action"]), {})
        elif tag == "input" and self._form is not None:
            if a.get("type") == "hidden":
                self._form[2][a["name"]] = a.get("value", "")
            elif a.get("type") == "text":
                self.search = (self._form[1], a["name"])
        elif tag == "button":
            self._button = []

    def handle_endtag(self, tag):
        if tag == "a" and self._a is not None:
            self._add(" ".join("".join(self._a[1]).split()), ("get", self._a[0], {}))
            self._a = None
        elif tag == "button" and self._button is not None and self._form is not None:
            method, action, fields = self._form
            self._add(" ".join("".join(self._button).split()), (method, action, dict(fields)))
            self._button = None
        elif tag == "form":
            self._form = None

    def _add(self, text, target):
        self.texts.append(text)
        self.clicks[text.lower()] = target

    def handle_data(self, data):
        for part in (self._a[1] if self._a else None, self._button):
            if part is not None:
                part.append(data)


def page_of(r: httpx.Response) -> _Page:
    p = _Page(str(r.url))
    p.feed(r.text)
    return p


def act(http: httpx.Client, r: httpx.Response, action: str) -> httpx.Response:
    """Do a WebShop action (search[...] / click[...]) on the page of response ``r``."""
    kind, arg = re.fullmatch(r"(search|click)\[(.*)\]", action).groups()
    page = page_of(r)
    if kind == "search":
        assert page.search is not None, f"no search box on {r.url}"
        return http.get(page.search[0], params={page.search[1]: arg})
    method, url, data = page.clicks[" ".join(arg.split()).lower()]
    return http.post(url, data=data) if method == "post" else http.get(url)


# -- catalogue ------------------------------------------------------------------------------------
def _rows(path) -> list[tuple]:
    con = sqlite3.connect(path)
    try:
        return con.execute("SELECT * FROM products ORDER BY rowid").fetchall()
    finally:
        con.close()


def test_catalogue_is_deterministic_and_large(tmp_path, cache, catalog):
    assert generate(300, seed=0) == generate(300, seed=0)
    assert generate(300, seed=0) != generate(300, seed=1)
    a, b = build(400, 3, tmp_path / "a"), build(400, 3, tmp_path / "b")
    assert _rows(a) == _rows(b) and len(_rows(a)) == 400
    mtime = a.stat().st_mtime_ns
    assert build(400, 3, tmp_path / "a") == a and a.stat().st_mtime_ns == mtime  # cached
    assert not list((tmp_path / "a").rglob("*.tmp"))

    products = [catalog.product(pid) for pid in catalog.product_ids()]
    assert len(products) == len(catalog) == 5000
    assert len({p.category for p in products}) == len(CATEGORIES) >= 10
    assert len({p.id for p in products}) == len({p.title for p in products}) == 5000
    for p in products:
        assert re.fullmatch(r"B0[0-9A-Z]{8}", p.id)
        assert 2 <= len(p.attributes) <= 5 and len(p.options) <= 3 and p.price_cents >= 100
        values = [v for _, vs in p.options for v in vs]
        assert len(values) == len(set(values))  # an option's text names one option on the page
    assert sum(bool(p.options) for p in products) > 3000


def test_exact_title_ranks_first(catalog, http):
    rng = random.Random(0)
    for pid in rng.sample(catalog.product_ids(), 100):
        assert catalog.search(catalog.product(pid).title)[0] == pid
    pid = catalog.product_ids()[123]
    r = http.get("/s/rank/search", params={"q": catalog.product(pid).title.lower()})
    assert next(t for t in page_of(r).texts if t.startswith("B0")) == pid
    assert catalog.search("xyzzy qwertyuiop") == () and catalog.search("!!! ???") == ()


# -- goals and reward -----------------------------------------------------------------------------
def test_goals_are_deterministic_split_and_satisfiable(catalog):
    goals = make_goals(catalog)
    assert goals == make_goals(catalog)
    train = [g for g in goals.values() if g.split == "train"]
    test = [g for g in goals.values() if g.split == "test"]
    assert len(train) >= 1000 and len(test) >= 200
    assert train[42].id == "shop-train-00042" and test[7].id == "shop-test-00007"
    assert {g.target for g in train}.isdisjoint(g.target for g in test)
    for g in goals.values():
        assert reward(g, catalog.product(g.target), dict(g.options)).reward == 1.0
        assert g.instruction.endswith(f"price lower than {g.price_cents / 100:.2f} dollars")


def _product(**kw) -> Product:
    base = dict(id="B0TEST0001", title="T", category="clothing", type="t-shirt", brand="B",
                price_cents=2500, attributes=("cotton", "machine washable", "slim fit"),
                options=(("size", ("small", "large")), ("color", ("red", "navy blue"))),
                description="d", features=())  # fmt: skip
    return Product(**{**base, **kw})


def test_reward_cases():
    goal = Goal("g", "train", "i need ...", "B0TEST0001", "clothing", "t-shirt",
                ("cotton", "machine washable"), (("size", "large"), ("color", "navy blue")),
                3000, "q")  # fmt: skip
    ok = {"size": "large", "color": "navy blue"}
    assert reward(goal, _product(), ok).reward == 1.0
    # 2 attrs + 2 options + price: each missing part costs 1/5
    assert reward(goal, _product(), {"size": "large"}).reward == pytest.approx(4 / 5)
    assert reward(goal, _product(), {}).reward == pytest.approx(3 / 5)
    assert reward(goal, _product(price_cents=3001), ok).reward == pytest.approx(4 / 5)
    assert reward(goal, _product(price_cents=3000), ok).reward == 1.0  # the bound is inclusive
    assert reward(goal, _product(attributes=("polyester",)), ok).reward == pytest.approx(3 / 5)
    # another type of the same category halves it; another category is a tenth
    assert reward(goal, _product(type="hoodie"), ok).reward == pytest.approx(0.5)
    r = reward(goal, _product(category="shoes", type="sneakers", attributes=()), {})
    assert r.reward == pytest.approx(0.1 * 1 / 5) and r.price_ok and r.attributes_matched == 0
    no_options = Goal("h", "test", "", "x", "clothing", "t-shirt", ("cotton",), (), 1000, "q")
    assert reward(no_options, _product(), {}).reward == pytest.approx(1 / 2)  # over budget


# -- the site -------------------------------------------------------------------------------------
def _unique_clicks(page: _Page) -> None:
    assert len(page.texts) == len({t.lower() for t in page.texts}), page.texts


def test_every_page_renders(http, catalog):
    assert http.get("/healthz").text == "ok"
    assert "Start shopping" in http.get("/").text
    r = http.get("/start")
    assert r.status_code == 200 and 'id="instruction"' in r.text
    train = http.get("/goals", params={"split": "train"}).json()
    assert len(train) >= 1000 and len(http.get("/goals?split=test").json()) >= 200
    assert http.get("/goals?split=nope").status_code == 400
    goal = http.get(f"/goal/{train[3]}").json()
    assert goal["id"] == train[3] and goal["instruction"]
    assert http.get("/goal/shop-train-99999").status_code == 404
    assert http.get("/s/p/reset", params={"goal": "no-such-goal"}).status_code == 404

    r = http.get("/s/p/reset", params={"goal": train[3]})  # home
    assert r.url.path == "/s/p/" and r.text.count("<form") == 1 and 'name="q"' in r.text
    assert f'Instruction: <span class="text">{goal["instruction"]}' in r.text
    assert page_of(r).texts == ["Search"]
    r = http.get("/s/p/search", params={"q": "   "})  # empty search: home with a message
    assert "Please type what you are looking for." in r.text and 'name="q"' in r.text
    r = http.get("/s/p/search", params={"q": "zzzqqq xxyyzz"})  # nothing found
    assert r.status_code == 200 and 'No results for "zzzqqq xxyyzz"' in r.text
    assert page_of(r).texts == ["Back to Search"]

    r = act(http, http.get("/s/p/"), "search[cotton t-shirt navy blue]")
    page = page_of(r)
    assert "Next >" in page.texts and "< Prev" not in page.texts and "Page 1 of 5" in r.text
    _unique_clicks(page)
    pids = [t for t in page.texts if re.fullmatch(r"B0[0-9A-Z]{8}", t)]
    assert len(pids) == 10
    r2 = act(http, r, "click[Next >]")
    assert "Page 2 of 5" in r2.text and "< Prev" in page_of(r2).texts
    assert act(http, r2, "click[< Prev]").text == r.text  # deterministic
    assert http.get("/s/p3/search?q=cotton&page=999").text.count("Page 5 of 5") == 1  # clamped

    pid = next(p for p in pids if len(catalog.product(p).options) >= 2)
    product = catalog.product(pid)
    r = act(http, r, f"click[{pid}]")
    page = page_of(r)
    _unique_clicks(page)
    assert {"Buy Now", "< Prev", "Back to Search", "Description", "Features"} <= set(page.texts)
    assert product.title in r.text and product.price in r.text
    (_, v1), (g2, v2) = ((g, vs[-1]) for g, vs in product.options[:2])
    r = act(http, r, f"click[{v1}]")
    assert f'>{v1}</a> <span class="selected">(selected)</span>' in r.text
    r = act(http, r, "click[Buy Now]")  # an option group left: the page again, with a message
    assert r.status_code == 200 and f"Please select {g2}" in r.text and "bpo-done" not in r.text
    assert "(selected)" in r.text
    r = act(http, r, f"click[{v2}]")
    assert r.text.count("(selected)") == 2
    d = act(http, r, "click[Description]")
    assert product.description in d.text
    assert act(http, d, "click[< Prev]").text == r.text  # options kept
    f = act(http, r, "click[Features]")
    assert all(line in f.text for line in product.features)
    back = act(http, r, "click[< Prev]")
    assert "Page 1 of 5" in back.text
    r = act(http, act(http, back, f"click[{pid}]"), f"click[{v1}]")
    r = act(http, act(http, r, f"click[{v2}]"), "click[Buy Now]")
    assert r.url.path == "/s/p/done" and "Thank you" in r.text
    reward_meta = page_of(r).meta
    assert reward_meta["bpo-done"] == "1" and 0.0 <= float(reward_meta["bpo-reward"]) <= 1.0
    for path in ("/s/p/", "/s/p/search?q=shoes", f"/s/p/item/{pid}", "/s/p/page"):
        assert http.get(path).text == r.text  # a finished episode shows only its end
    assert http.get("/s/p/expert").json() == {"action": None}

    r = http.get("/s/p2/item/B0NOTHERE0")
    assert r.status_code == 404 and "There is no product with that id." in r.text
    assert http.get("/s/p2/nowhere/at/all").status_code == 404
    assert http.get("/s/bad!name/").status_code == 404
    assert http.get(f"/s/p2/item/{pid}/buy").status_code in (404, 405)


def test_sessions_are_isolated(http):
    goals = http.get("/goals?split=test").json()
    http.get("/s/iso-a/reset", params={"goal": goals[0]})
    http.get("/s/iso-b/reset", params={"goal": goals[1]})
    a = http.get("/s/iso-a/search", params={"q": "yoga mat"})
    b = http.get("/s/iso-b/page")
    assert "Search" in b.text and "yoga mat" not in b.text
    sa, sb = http.get("/s/iso-a/state").json(), http.get("/s/iso-b/state").json()
    assert (sa["goal"], sa["page"], sa["query"]) == (goals[0], "results", "yoga mat")
    assert (sb["goal"], sb["page"], sb["query"]) == (goals[1], "home", "")
    assert http.get("/s/iso-a/page").text == a.text


def test_state_export_import_round_trips(http, catalog):
    gid = http.get("/goals?split=train").json()[7]
    http.get("/s/snap/reset", params={"goal": gid})
    steps = [lambda: http.get("/s/snap/search", params={"q": "gluten free protein bars"})]
    r = steps[0]()
    pid = next(t for t in page_of(r).texts if catalog.product(t) and catalog.product(t).options)
    r = act(http, r, f"click[{pid}]")
    r = act(http, r, "click[Buy Now]")  # leaves a message on the page: part of the state
    state = http.get("/s/snap/state").json()
    assert state["page"] == "item" and state["message"] and state["url"] == f"/s/snap/item/{pid}"
    assert json.loads(json.dumps(state)) == state
    page = http.get("/s/snap/page").text
    assert page == r.text

    act(http, act(http, r, "click[Back to Search]"), "search[office chair]")  # move on
    assert http.get("/s/snap/page").text != page
    put = http.put("/s/snap/state", json=state)
    assert put.status_code == 200
    assert http.get("/s/snap/state").json() == state
    assert http.get("/s/snap/page").text == page
    # into another session: the same page, up to the session's name in its links
    assert http.put("/s/snap2/state", json=state).status_code == 200
    assert http.get("/s/snap2/page").text == page.replace("/s/snap/", "/s/snap2/")
    group = catalog.product(pid).options[0][0]
    for bad in (
        [1], {"page": "nowhere"}, {"goal": "nope"}, {"product": "B0NOTHERE0"}, {"page_no": "2"},
        {"extra": 1}, {"page": "item"}, {"reward": 2.0}, {"options": {"size": "large"}},
        {**state, "options": {"sid": "x"}}, {**state, "options": {group: "no such value"}},
    ):  # fmt: skip
        assert http.put("/s/snap/state", json=bad).status_code == 400, bad
    assert http.put("/s/snap/state", content=b"{not json").status_code == 400
    assert http.get("/s/snap/page").text == page  # a refused import changes nothing


def test_expert_reaches_reward_one_through_http(http):
    train, test = http.get("/goals?split=train").json(), http.get("/goals?split=test").json()
    for n, gid in enumerate(train[:20] + test[:5]):
        sid = f"expert-{n}"
        r = http.get(f"/s/{sid}/reset", params={"goal": gid})
        actions = []
        while (action := http.get(f"/s/{sid}/expert").json()["action"]) is not None:
            actions.append(action)
            r = act(http, r, action)
            assert r.status_code == 200 and len(actions) <= 10, actions
        assert page_of(r).meta == {"viewport": page_of(r).meta["viewport"], "bpo-reward": "1.0000",
                                   "bpo-done": "1"}, (gid, actions)  # fmt: skip
        assert actions[0].startswith("search[") and actions[-1] == "click[Buy Now]"
        if n == 0:  # the same actions from reset give the same bytes
            again = http.get(f"/s/{sid}b/reset", params={"goal": gid})
            for action in actions:
                again = act(http, again, action)
            assert again.text == r.text.replace(f"/s/{sid}/", f"/s/{sid}b/")


# -- fuzz -----------------------------------------------------------------------------------------
_JUNK = ["", " ", "%00", "%ff%fe", "..", "../..", "🛒", "ünïcödé", "名前", "<script>", "' OR 1=1 --",
         '"', "NEAR(", "a AND", "*", "^title", "x" * 5000, "B0", "B0AAAAAAAA", "-1", "99999999999",
         "1e9", "NaN", "\u202e", "q=1&q=2", "%", "{}", "[]"]  # fmt: skip


def _fuzz_request(rng: random.Random, pids: list[str], gids: list[str]) -> tuple[str, str, dict]:
    def junk() -> str:
        if rng.random() < 0.7:
            return rng.choice(_JUNK)
        return "".join(chr(rng.randint(1, 0x2FFF)) for _ in range(rng.randint(1, 40)))

    sid = (
        rng.choice(["fz", "fz2", "a" * 64])
        if rng.random() < 0.75
        else rng.choice(["a" * 65, "bad name", "ü", junk()])
    )
    path = rng.choice([
        "/", "/start", "/healthz", "/goals", "/goal/{g}", "/s/{s}/", "/s/{s}/reset",
        "/s/{s}/search", "/s/{s}/item/{p}", "/s/{s}/item/{p}/description", "/s/{s}/item/{p}/buy",
        "/s/{s}/item/{p}/features", "/s/{s}/item/{p}/{j}", "/s/{s}/state", "/s/{s}/page",
        "/s/{s}/expert", "/s/{s}/done", "/s/{s}/{j}", "/{j}", "/s/{s}/item/{j}", "/s/{s}/item/",
    ])  # fmt: skip
    path = path.format(s=sid, p=rng.choice(pids), g=rng.choice([*gids, junk()]), j=junk())
    params = {}
    for _ in range(rng.randint(0, 3)):
        key = rng.choice(["q", "page", "goal", "split", "size", "color", junk()])
        params[key] = rng.choice([junk(), rng.choice(gids), "train", "test", "2", "large"])
    if rng.random() < 0.05:
        params["q"] = "shoes " * rng.randint(2000, 20000)  # a huge query
    method = rng.choice(["GET"] * 6 + ["POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    if path.endswith(("/buy", "/state")) and rng.random() < 0.7:
        method = "POST" if path.endswith("/buy") else "PUT"
    kw: dict = {"params": params}
    if method in ("POST", "PUT", "PATCH"):
        body = rng.choice([
            junk().encode("utf-8", "surrogatepass"), {"size": junk(), "color": "red"},
            {"goal": rng.choice(gids), "page": rng.choice(["item", "results", junk()]),
             "product": rng.choice(pids), "page_no": rng.choice([1, -1, 10**9, "x"])},
        ])  # fmt: skip
        kind = "content" if isinstance(body, bytes) else rng.choice(["data", "json"])
        kw[kind] = body
    return method, path, kw


def test_fuzz_never_5xx_and_keeps_answering(shop, http, catalog):
    rng = random.Random(1234)
    pids = catalog.product_ids()[:50]
    gids = http.get("/goals?split=train").json()[:20]
    statuses: dict[int, int] = {}
    walk = http.get("/s/walk/reset", params={"goal": gids[0]})
    for _ in range(800):
        if rng.random() < 0.25:  # a random agent: any click on its page, or a junk search
            page = page_of(walk)
            if page.search is not None and rng.random() < 0.5:
                q = rng.choice([*_JUNK, "shoes", "organic green tea"])
                walk = act(http, walk, f"search[{q}]")
            elif page.texts:
                walk = act(http, walk, f"click[{rng.choice(page.texts)}]")
            else:
                walk = http.get("/s/walk/reset", params={"goal": rng.choice(gids)})
            assert walk.status_code == 200, (walk.url, walk.status_code)
            statuses[0] = statuses.get(0, 0) + 1
            continue
        method, path, kw = _fuzz_request(rng, pids, gids)
        try:
            r = http.request(method, path, **kw)
        except httpx.InvalidURL:
            continue  # the client refused to send it
        assert r.status_code < 500, (method, path, kw, r.status_code, r.text[:300])
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    assert sum(statuses.values()) >= 500
    assert statuses.get(200, 0) > 100 and statuses.get(404, 0) > 20 and statuses.get(0, 0) > 100
    host, port = shop.removeprefix("http://").split(":")
    for raw in (b"GARBAGE\r\n\r\n", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                b"\x00\xff" * 100, b"GET / HTTP/1.1\r\nContent-Length: -5\r\n\r\n"):  # fmt: skip
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(raw)
            s.settimeout(10)
            try:
                reply = s.recv(100)
            except (TimeoutError, ConnectionResetError):
                reply = b""
            assert not reply.startswith(b"HTTP/1.1 5"), (raw[:40], reply)
    assert http.get("/healthz").text == "ok"
    gid = gids[0]
    r = http.get("/s/after-fuzz/reset", params={"goal": gid})
    assert r.status_code == 200 and 'name="q"' in r.text


def test_bpo_serve_shop_prints_its_url(cache):
    cmd = [sys.executable, "-m", "bpo.cli", "serve-shop", "--port", "0", "--cache-dir", str(cache),
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        url = re.search(r"http://127\.0\.0\.1:\d+/", proc.stdout.readline()).group(0)
        deadline = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(url + "healthz").text == "ok"
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert "Start shopping" in httpx.get(url).text
    finally:
        proc.terminate()
        proc.wait(10)

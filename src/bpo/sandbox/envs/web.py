"""``web``: a web agent on a real HTTP site, in WebShop's action language.

The client turns any HTML page into the text an agent sees (the page's visible text, with every
clickable element shown as ``[text]``) and accepts WebShop's actions (Yao et al. 2022):

* ``search[QUERY]`` fills the page's search box (the one form with a text input) and submits it;
* ``click[TEXT]`` follows the link, or presses the button, whose visible text is TEXT (case and
  runs of spaces ignored).

It speaks plain HTTP (httpx) and needs no JavaScript, so its page handling works on any site
that works without JavaScript. Episodes, snapshots and the expert use the shop's session
endpoints (``bpo.web``: ``/s/{sid}/reset``, ``/state``, ``/page``, ``/expert``); the site keeps
the episode's state server-side, so a native snapshot is that state exported as JSON and a
restore imports it. Replay (reset and the action prefix again) is the fallback that works for
any deterministic site.

A reward arrives on the page after a purchase (``<meta name="bpo-reward">``); success is reward
1. An action that is not WebShop's syntax, a click on something that is not on the page, or a
search on a page without a search box leaves the page as it was and says why.

Without ``url``, the first sandbox of a process starts the shop on a free loopback port (a
subprocess, stopped at exit) and the others share it; give ``url`` to use a running server
(``bpo serve-shop``), as the Ray pool does so that many sandboxes share one site.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import itertools
import json
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any
from urllib.parse import urljoin

from bpo.sandbox.envs import ENVS
from bpo.sandbox.protocol import EnvSpec, Observation, Sandbox, StepResult

_ACTION = re.compile(r"^\s*(search|click)\s*\[(.*)\]\s*$", re.DOTALL | re.IGNORECASE)
_BLOCKS = {"p", "div", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "form", "br", "ul",
           "ol", "table", "section", "header", "footer", "nav", "main", "article"}  # fmt: skip
_SKIP = {"script", "style", "head", "template", "noscript"}


def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


@dataclass
class Clickable:
    """A link or a form button on a page."""

    text: str
    method: str
    url: str
    data: dict[str, str] = field(default_factory=dict)


@dataclass
class _Form:
    action: str
    method: str
    fields: dict[str, str] = field(default_factory=dict)
    text_input: str | None = None
    buttons: list[tuple[int, str | None, str | None]] = field(default_factory=list)


@dataclass
class Page:
    """A parsed page: its visible text and what can be clicked or searched."""

    url: str
    text: str
    clickables: list[Clickable]
    search: tuple[str, str, str, dict[str, str]] | None
    """(method, url, field name, other fields) of the search form, if the page has one."""
    meta: dict[str, str]

    def find(self, target: str) -> Clickable | None:
        want = _norm(target)
        for c in self.clickables:
            if _norm(c.text) == want:
                return c
        return None


class _Parser(HTMLParser):
    def __init__(self, url: str) -> None:
        super().__init__(convert_charrefs=True)
        self.url = url
        self.parts: list[str] = []
        self.clickables: list[Clickable] = []
        self.meta: dict[str, str] = {}
        self.forms: list[_Form] = []
        self._skip = 0
        self._link: tuple[str, list[str]] | None = None
        self._button: tuple[str | None, str | None, list[str]] | None = None
        self._form: _Form | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: (v or "") for k, v in attrs}
        if tag in _SKIP:
            self._skip += 1
            if tag != "head":
                return
        if tag == "meta" and "name" in a:
            self.meta[a["name"]] = a.get("content", "")
        if self._skip:
            return
        if tag in _BLOCKS:
            self.parts.append("\n")
        if tag == "a" and "href" in a:
            self._link = (urljoin(self.url, a["href"]), [])
        elif tag == "form":
            self._form = _Form(urljoin(self.url, a.get("action") or self.url),
                               (a.get("method") or "get").lower())  # fmt: skip
            self.forms.append(self._form)
        elif tag == "input" and self._form is not None:
            kind = (a.get("type") or "text").lower()
            name = a.get("name")
            if kind in ("text", "search") and name:
                self._form.text_input = name
            elif kind == "submit":
                self._add_button(a.get("value") or "Submit", a.get("name"), a.get("value"))
            elif name and (kind == "hidden" or (kind in ("radio", "checkbox") and "checked" in a)):
                self._form.fields[name] = a.get("value", "")
        elif tag == "button":
            self._button = (a.get("name"), a.get("value"), [])

    def _add_button(self, text: str, name: str | None, value: str | None) -> None:
        form = self._form
        if form is None:
            return
        data = dict(form.fields)
        if name:
            data[name] = value or ""
        self.clickables.append(Clickable(text, form.method, form.action, data))
        self.parts.append(f"[{text}]")

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIP:
            self._skip = max(0, self._skip - 1)
            return
        if self._skip:
            return
        if tag == "a" and self._link is not None:
            href, texts = self._link
            text = " ".join("".join(texts).split())
            if text:
                self.clickables.append(Clickable(text, "get", href))
                self.parts.append(f"[{text}]")
            self._link = None
        elif tag == "button" and self._button is not None:
            name, value, texts = self._button
            self._button = None
            text = " ".join("".join(texts).split())
            if text and self._form is not None:
                self._add_button(text, name, value)
        elif tag == "form":
            self._form = None
        if tag in _BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self._skip:
            return
        if self._link is not None:
            self._link[1].append(data)
        elif self._button is not None:
            self._button[2].append(data)
        else:
            self.parts.append(data)


def parse_page(url: str, body: str) -> Page:
    """The agent's view of an HTML page."""
    p = _Parser(url)
    p.feed(body)
    p.close()
    lines = [" ".join(line.split()) for line in "".join(p.parts).split("\n")]
    text = "\n".join(line for line in lines if line)
    search = None
    for form in p.forms:
        if form.text_input is not None:
            search = (form.method, form.action, form.text_input, dict(form.fields))
            break
    return Page(url, text, p.clickables, search, p.meta)


@functools.lru_cache(maxsize=1)
def _local_shop() -> str:
    """The URL of a shop this process started (once; stopped at exit)."""
    from bpo.web.serve import start_server

    url, stop = start_server()
    atexit.register(stop)
    return url


class WebEngine:
    """The web sandbox's engine (``bpo.sandbox.protocol.Engine`` with native state)."""

    _ids = itertools.count()
    _lock = threading.Lock()

    def __init__(
        self, url: str | None = None, max_steps: int = 15, max_obs_chars: int = 3000,
        timeout: float = 30.0,
    ) -> None:  # fmt: skip
        import httpx

        self.url = (url or _local_shop()).rstrip("/")
        with self._lock:
            self.sid = f"bpo-{os.getpid()}-{next(self._ids)}"
        self.max_steps = max_steps
        self.max_obs_chars = max_obs_chars
        self._http = httpx.Client(timeout=timeout, follow_redirects=True)
        self._page: Page | None = None
        self._instruction = ""
        self._steps = 0
        self._done = False

    # -- http ----------------------------------------------------------------------------
    def _fetch(self, method: str, url: str, data: dict[str, str] | None = None) -> Page:
        if method == "post":
            r = self._http.post(url, data=data or {})
        else:
            r = self._http.get(url, params=data or None)
        if r.status_code >= 500:
            raise RuntimeError(f"the shop answered {r.status_code} to {method.upper()} {url}")
        return parse_page(str(r.url), r.text)

    def _session(self, path: str) -> str:
        return f"{self.url}/s/{self.sid}/{path}"

    # -- episode -------------------------------------------------------------------------
    def reset(self, task: str, seed: int = 0) -> Observation:
        r = self._http.get(self._session("reset"), params={"goal": task})
        if r.status_code == 404:
            raise ValueError(f"unknown web task {task!r}: {r.text.strip()[:200]}")
        if r.status_code >= 400:
            raise RuntimeError(f"the shop answered {r.status_code} to reset({task!r})")
        self._page = parse_page(str(r.url), r.text)
        self._instruction = self._instruction_of(self._page)
        self._steps = 0
        self._done = False
        return self._observation()

    def _instruction_of(self, page: Page) -> str:
        line = next(
            (ln for ln in page.text.splitlines() if ln.lower().startswith("instruction")), ""
        )
        return line.split(":", 1)[-1].strip() if line else ""

    def step(self, action: str) -> StepResult:
        if self._page is None:
            raise RuntimeError("reset() the web engine before step()")
        if self._done:
            return self._result(0.0, True, note="The episode is over.")
        self._steps += 1
        note = ""
        try:
            action.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: nothing a browser could send
            action = ""
        m = _ACTION.match(action)
        if m is None:
            note = "Invalid action: use search[query] or click[element]."
        elif m.group(1).lower() == "search":
            if self._page.search is None:
                note = "There is no search box on this page."
            else:
                method, url, name, fields = self._page.search
                self._page = self._fetch(method, url, {**fields, name: m.group(2).strip()})
        else:
            target = self._page.find(m.group(2))
            if target is None:
                note = f"There is no {m.group(2).strip()[:80]!r} to click on this page."
            else:
                self._page = self._fetch(target.method, target.url, target.data)
        reward = float(self._page.meta.get("bpo-reward", 0.0) or 0.0)
        self._done = self._page.meta.get("bpo-done") == "1"
        truncated = not self._done and self._steps >= self.max_steps
        return self._result(reward if self._done else 0.0, self._done, truncated, note)

    def _result(
        self, reward: float, terminated: bool, truncated: bool = False, note: str = ""
    ) -> StepResult:
        obs = self._observation(note, done=terminated or truncated)
        return StepResult(obs, reward, terminated, truncated, {"url": self._page_path()})

    def _page_path(self) -> str:
        return self._page.url.replace(self.url, "").replace(self.sid, "SID") if self._page else ""

    def _observation(self, note: str = "", done: bool = False) -> Observation:
        page = self._page
        assert page is not None
        text = (note + "\n" if note else "") + page.text
        if len(text) > self.max_obs_chars:
            text = (
                text[: self.max_obs_chars]
                + f"\n[... {len(text) - self.max_obs_chars} characters cut]"
            )
        clicks = tuple(dict.fromkeys(f"click[{c.text}]" for c in page.clickables))
        # a page with a search box takes any query: the admissible list cannot enumerate it
        admissible = None if page.search is not None else clicks
        return Observation(text, self._instruction, admissible, done)

    def expert_action(self) -> str | None:
        if self._done:
            return None
        r = self._http.get(self._session("expert"))
        return r.json().get("action") if r.status_code == 200 else None

    # -- state ---------------------------------------------------------------------------
    def _state_json(self) -> str:
        r = self._http.get(self._session("state"))
        r.raise_for_status()
        return r.text

    def fingerprint(self) -> str:
        state = self._state_json().replace(self.sid, "SID")  # not the session's own name
        blob = json.dumps([state, self._steps, self._done])
        return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()

    def get_state(self) -> tuple[str, int, bool, str]:
        return (self._state_json().replace(self.sid, "\0SID\0"), self._steps, self._done,
                self._instruction)  # fmt: skip

    def set_state(self, state: tuple[str, int, bool, str]) -> None:
        body, self._steps, self._done, self._instruction = state
        r = self._http.put(self._session("state"), content=body.replace("\0SID\0", self.sid),
                           headers={"content-type": "application/json"})  # fmt: skip
        r.raise_for_status()
        self._page = self._fetch("get", self._session("page"))

    def close(self) -> None:
        self._http.close()


def make(*, backend: str = "auto", **options: Any) -> Sandbox:
    """A web sandbox; ``options`` go to :class:`WebEngine` (``url``: a running shop)."""
    from bpo.sandbox import make_sandbox

    if backend not in ("auto", "native", "replay"):
        raise ValueError(
            f"the web sandbox supports backends auto, native and replay, not {backend!r}: its "
            "state lives in the shop server, which fork and pickle snapshots do not copy"
        )
    return make_sandbox(functools.partial(WebEngine, **options), backend=backend)


def tasks(split: str = "train", url: str | None = None, **_: Any) -> Sequence[str]:
    """Goal ids of ``split`` ("train" or "test"), from the shop."""
    import httpx

    if split not in ("train", "test"):
        raise ValueError(f"web tasks have splits 'train' and 'test', not {split!r}")
    r = httpx.get(
        f"{(url or _local_shop()).rstrip('/')}/goals", params={"split": split}, timeout=30
    )
    r.raise_for_status()
    return list(r.json())


ENVS.register("web")(EnvSpec(
    name="web", make=make, tasks=tasks,
    description="a local web shop in WebShop's style (Starlette, SQLite FTS5) over HTTP, "
                "WebShop's action language; native snapshots of the server-side session",
))  # fmt: skip

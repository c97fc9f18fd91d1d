"""The web sandbox: the page parser on hand-written HTML, and against the real shop server (a
subprocess on loopback): the sandbox contract for both snapshot backends, the expert through
WebShop's action language, and bad actions answered as a shop would."""

from __future__ import annotations

import os

import pytest

from bpo.sandbox import check_sandbox
from bpo.sandbox.envs import web
from bpo.sandbox.envs.web import WebEngine, parse_page

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

PAGE = """<!doctype html><html><head><title>t</title><style>p{}</style>
<meta name="bpo-reward" content="0.5"></head><body>
<div id="instruction">Instruction: find a red mug</div>
<script>var hidden = "not text";</script>
<form method="get" action="/s/x/search"><input type="hidden" name="page" value="1">
<input type="text" name="q"><button type="submit">Search</button></form>
<ul><li><a href="/s/x/item/B01">B01</a> Red mug <b>$9.99</b></li>
<li><a href="item/B02">  Blue   mug </a></li></ul>
<form method="post" action="/s/x/buy"><input type="hidden" name="item" value="B01">
<button type="submit" name="go" value="1">Buy Now</button></form>
</body></html>"""


def test_parse_page_text_clickables_and_search():
    page = parse_page("http://shop/s/x/home", PAGE)
    assert "Instruction: find a red mug" in page.text
    assert "not text" not in page.text and "p{}" not in page.text
    assert "[B01] Red mug $9.99" in page.text
    assert [c.text for c in page.clickables] == ["Search", "B01", "Blue mug", "Buy Now"]
    assert page.find("blue  MUG").url == "http://shop/s/x/item/B02"  # case, spaces ignored
    buy = page.find("buy now")
    assert (buy.method, buy.url, buy.data) == (
        "post",
        "http://shop/s/x/buy",
        {"item": "B01", "go": "1"},
    )
    assert page.search == ("get", "http://shop/s/x/search", "q", {"page": "1"})
    assert page.meta["bpo-reward"] == "0.5"
    assert page.find("nothing") is None


@pytest.fixture(scope="module")
def shop():
    from bpo.web.serve import start_server

    url, stop = start_server()
    yield url
    stop()


@pytest.fixture()
def engine(shop):
    e = WebEngine(url=shop)
    yield e
    e.close()


def test_tasks_have_both_splits(shop):
    train, test = web.tasks("train", url=shop), web.tasks("test", url=shop)
    assert len(train) >= 1000 and len(test) >= 200 and not set(train) & set(test)


@pytest.mark.parametrize("backend", ["native", "replay"])
def test_check_sandbox_passes(shop, backend):
    tasks = web.tasks("train", url=shop)[:2]
    report = check_sandbox(lambda: web.make(backend=backend, url=shop), tasks, max_steps=8,
                           stress_nodes=12)  # fmt: skip
    assert len(report.properties) == 7


def test_expert_buys_the_right_thing(engine, shop):
    for goal in web.tasks("train", url=shop)[:5] + web.tasks("test", url=shop)[:3]:
        obs = engine.reset(goal, 0)
        assert obs.instruction and obs.admissible is None  # a search page takes any query
        for _ in range(15):
            action = engine.expert_action()
            res = engine.step(action)
            if res.terminated:
                break
        assert res.terminated and res.reward == 1.0, (goal, action, res.observation.text[:500])


def test_bad_actions_are_answered_like_a_shop(engine, shop):
    goal = web.tasks("train", url=shop)[0]
    engine.reset(goal, 0)
    for action, says in [
        ("buy the red one", "Invalid action"),
        ("click[]", "There is no"),
        ("click[a button that is not there]", "There is no"),
        ("search[", "Invalid action"),
    ]:
        res = engine.step(action)
        assert says in res.observation.text and res.reward == 0 and not res.terminated, action
    res = engine.step("search[zzqqxx nothing matches this]")
    assert not res.terminated  # an empty result page, not an error
    engine.reset(goal, 0)
    engine.step(engine.expert_action())  # search
    res = engine.step(engine.expert_action())  # open the product
    assert res.observation.admissible and "click[Buy Now]" in res.observation.admissible
    assert "There is no search box" in engine.step("search[anything]").observation.text


def test_unknown_goal_and_backend_are_clear(shop):
    e = WebEngine(url=shop)
    with pytest.raises(ValueError, match="unknown web task"):
        e.reset("shop-train-99999999", 0)
    e.close()
    with pytest.raises(ValueError, match="backends auto, native and replay"):
        web.make(backend="fork", url=shop)

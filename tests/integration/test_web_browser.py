"""The shop as people see it: headless Chromium (Debian's package) walks search, product,
options and buy on the real server, driven through the DevTools protocol (typing into the
search box and clicking links and buttons in the page), and saves a screenshot of each step.
The expert's next move is read from the shop for the same session, so the walk buys the goal's
product; the test fails (it does not skip) without Chromium."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

_WS = re.compile(r"DevTools listening on (ws://\S+)")


class Tab:
    """One page target over the DevTools protocol (aiohttp's websocket client)."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.n = 0

    async def call(self, method: str, **params):
        self.n += 1
        await self.ws.send_json({"id": self.n, "method": method, "params": params})
        while True:
            msg = json.loads((await self.ws.receive()).data)
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def js(self, expression: str):
        res = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return res["result"].get("value")

    async def settle(self, before: str) -> None:
        """Wait until a navigation away from ``before`` has loaded."""
        for _ in range(200):
            state = await self.js("[location.href, document.readyState]")
            if state and state[0] != before and state[1] == "complete":
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"the page did not navigate away from {before}")

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))


CLICK = """(() => {
  const want = %s.toLowerCase().replace(/\\s+/g, ' ').trim();
  const els = [...document.querySelectorAll('a, button, input[type=submit]')];
  const el = els.find(e => (e.innerText || e.value || '').toLowerCase().replace(/\\s+/g, ' ').trim() === want);
  if (!el) return false;
  el.click();
  return true;
})()"""

SEARCH = """(() => {
  const box = document.querySelector('form input[type=text], form input[type=search]');
  box.value = %s;
  box.form.requestSubmit ? box.form.requestSubmit() : box.form.submit();
  return true;
})()"""


async def walk(chromium: str, shop: str, goal: str, out: Path) -> dict:
    profile = out / "profile"
    proc = await asyncio.create_subprocess_exec(
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--window-size=1280,900", "--remote-debugging-port=0",
        "about:blank", stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    import aiohttp

    try:
        assert proc.stderr is not None
        ws_url = None
        while ws_url is None:
            line = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()
            assert line, "chromium exited before its DevTools endpoint was up"
            m = _WS.search(line)
            ws_url = m.group(1) if m else None
        port = ws_url.split(":")[2].split("/")[0]
        async with aiohttp.ClientSession() as http:
            targets = await (await http.get(f"http://127.0.0.1:{port}/json/list")).json()
            page = next(t for t in targets if t["type"] == "page")
            async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                tab = Tab(ws)
                await tab.call("Page.enable")
                sid = "browser-walk"
                await tab.call("Page.navigate", url=f"{shop}/s/{sid}/reset?goal={goal}")
                await tab.settle("about:blank")
                steps = []
                for i in range(12):
                    await tab.screenshot(out / f"step{i:02d}.png")
                    action = httpx.get(f"{shop}/s/{sid}/expert").json()["action"]
                    if action is None:
                        break
                    steps.append(action)
                    kind, arg = action.split("[", 1)
                    arg = arg[:-1]
                    before = await tab.js("location.href")
                    code = (SEARCH if kind == "search" else CLICK) % json.dumps(arg)
                    assert await tab.js(code), f"no element for {action} on {before}"
                    await tab.settle(before)
                reward = await tab.js(
                    "document.querySelector('meta[name=bpo-reward]')?.content ?? null"
                )
                text = await tab.js("document.body.innerText")
                await tab.screenshot(out / "bought.png")
                return {"steps": steps, "reward": reward, "text": text}
    finally:
        proc.kill()
        await proc.wait()


def test_a_person_can_search_choose_and_buy(tmp_path: Path) -> None:
    from bpo.sandbox.envs import web
    from bpo.web.serve import start_server

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail("headless Chromium is needed: `apt-get install -y chromium` (make setup)")
    url, stop = start_server()
    try:
        goal = web.tasks("test", url=url)[0]
        result = asyncio.run(walk(chromium, url, goal, tmp_path))
    finally:
        stop()
    assert result["steps"][0].startswith("search[") and result["steps"][-1] == "click[Buy Now]"
    assert float(result["reward"]) == 1.0, result
    assert "thank you" in result["text"].lower()
    shots = sorted(tmp_path.glob("step*.png"))
    assert (
        len(shots) == len(result["steps"]) + 1 and (tmp_path / "bought.png").stat().st_size > 5000
    )
    if os.environ.get("BPO_ARTIFACTS"):
        dest = Path(os.environ["BPO_ARTIFACTS"])
        dest.mkdir(parents=True, exist_ok=True)
        for p in [*shots, tmp_path / "bought.png"]:
            shutil.copy(p, dest / f"shop-{p.name}")
    print(f"screenshots: {tmp_path}")

"""``bpo view``: the page renders real trees in headless Chromium (DOM after the script ran, and
a screenshot that shows coloured tree nodes), escapes hostile text, and the command's options.

Run directories are built here from real :class:`bpo.tree.Tree` objects, advantages from the real
estimator and metrics from :func:`bpo.metrics.tree_metrics` (no training). Chromium is Debian's
``chromium`` package; without it these tests fail (they do not skip).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from bpo import estimators
from bpo.cli import main as cli_main
from bpo.metrics import MetricsLogger, tree_metrics
from bpo.rollout.budget import Compute
from bpo.tree import Tree, Turn
from bpo.view import build_html, write_view

HOSTILE = '</script><script>window.PWNED=1</script><b id="inj">bold</b> & "q" \u2028 \x00 \u00e9'


def _turn(rng: np.random.Generator, text: str, reward: float, done: bool) -> Turn:
    n = int(rng.integers(2, 6))
    ids = tuple(int(i) for i in rng.integers(0, 500, n))
    return Turn(ids, tuple(-rng.random(n)), tuple(rng.random(n)), text, reward, terminated=done)


def make_tree(rng: np.random.Generator, task: str, depth: int = 5) -> Tree:
    """Root width 2; every node branches (K=2 or 3) with probability 0.35 until ``depth``; a leaf
    succeeds (reward 1) with probability 0.4. One node's observation is hostile markup."""
    tree = Tree(task, seed=int(rng.integers(1000)))
    tree.add_root([1, 2, 3], observation=f"You are in room 0 of {task}. Exits: north, east.")
    frontier = [(0, 2)]
    while frontier:
        parent, k = frontier.pop()
        tree.nodes[parent].branch_k = k
        tree.nodes[parent].entropy = float(rng.uniform(0.2, 2.5))
        for j in range(k):
            step = tree.nodes[parent].step + 1
            done = step >= depth or (step >= 3 and rng.random() < 0.3)
            reward = float(rng.random() < 0.4) if done else 0.0
            action = ["go north", "open door", "take key", "go east"][j % 4] + f" #{step}"
            obs = f"Step {step}: you {action.split(' #')[0]}. " + ("Done!" if reward else "Hmm.")
            child = tree.add_child(parent, _turn(rng, action, reward, done), [4, 5], obs)
            if not done:
                frontier.append(
                    (child, 3 if rng.random() < 0.2 else 2 if rng.random() < 0.3 else 1)
                )
    steps = len(tree) - 1
    tokens = sum(len(n.turn.action_ids) for n in tree.nodes if n.turn)
    tree.meta["compute"] = Compute(generated_tokens=tokens, sandbox_steps=steps, wall_seconds=2.0)
    return tree


def make_run(run_dir: Path, iterations: int = 3, per_iter: int = 2, seed: int = 0) -> list[dict]:
    """A run directory like ``bpo train`` writes; returns the logged trees (dicts)."""
    rng = np.random.default_rng(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"sandbox": {"name": "toy"}, "estimator": {"name": "bpo"}, "run": {"seed": seed},
           "tree": {"rule": "entropy_quantile", "k": 3, "root_width": 2},
           "budget": {"unit": "tokens", "amount": 400}, "policy": {"model": "tiny"}}  # fmt: skip
    (run_dir / "config.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    logger = MetricsLogger(run_dir, tensorboard=False)
    logged = []
    for it in range(1, iterations + 1):
        trees = [make_tree(rng, f"keydoor-{it}-{j}") for j in range(per_iter)]
        if it == iterations:  # the best leaf of the last tree is the one shown on load
            last = trees[0]
            best = max(last.leaves(), key=lambda i: (last.returns()[last.leaves().index(i)], -i))
            last.nodes[best].observation = HOSTILE
        extra = {"learner/grad_norm": 1.0 / it, "loss/pg": -0.1 * it, "learner/updates": it,
                 "time/iteration_s": 10.0, "eval/success": 0.1 * it}  # fmt: skip
        logger.log(it, {**tree_metrics(trees), **extra})
        with open(run_dir / "trees.jsonl", "a") as f:
            for t in trees:
                adv = estimators.compute("bpo", t.parents(), t.rewards()).advantage
                d = {**t.to_dict(adv.tolist()), "iteration": it}
                f.write(json.dumps(d) + "\n")
                logged.append(d)
    logger.close()
    summary = {"eval_before": {"success": 0.1}, "eval_after": {"success": 0.35},
               "iterations": iterations, "policy_updates": iterations}  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return logged


# -- the browser -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail(
            "headless Chromium is needed for the viewer tests: install Debian's package with "
            "`apt-get install -y chromium` (as root)"
        )
    return exe


def run_chromium(exe: str, tmp: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--window-size=1400,900", "--hide-scrollbars",
           "--virtual-time-budget=5000", *args, url]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"chromium failed ({out.returncode}): {out.stderr[-2000:]}"
    return out


class SvgNodes(HTMLParser):
    """Collects class lists of the elements inside ``svg#tree`` and the injected-element check."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.classes: list[list[str]] = []
        self.tree_attrs: dict[str, str | None] = {}
        self.injected = False
        self.body_attrs: dict[str, str | None] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id") == "inj":
            self.injected = True
        if tag == "body":
            self.body_attrs = a
        if tag == "svg" and a.get("id") == "tree":
            self.depth = 1
            self.tree_attrs = a
        elif self.depth:
            self.classes.append((a.get("class") or "").split())
            self.depth += 1

    def handle_endtag(self, tag: str) -> None:
        if self.depth:
            self.depth -= 1


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("view")
    logged = make_run(tmp / "run")
    return write_view(tmp / "run"), logged


def test_dom_after_script_draws_every_node_of_the_selected_tree(chromium, page, tmp_path):
    path, logged = page
    default = len(logged) - 2  # the first tree of the last iteration
    for index, url in ((0, path.as_uri() + "#tree=0"), (default, path.as_uri())):
        dom = run_chromium(chromium, tmp_path, url, "--dump-dom").stdout
        parser = SvgNodes()
        parser.feed(dom)
        nodes = logged[index]["nodes"]
        kids = [0] * len(nodes)
        for n in nodes[1:]:
            kids[n["parent"]] += 1
        node_classes = [c for c in parser.classes if "node" in c]
        assert parser.tree_attrs.get("data-tree") == str(index), parser.body_attrs
        assert len(node_classes) == len(nodes) == int(parser.tree_attrs["data-nodes"])
        assert sum("leaf" in c for c in node_classes) == kids.count(0)
        assert sum("branch" in c for c in node_classes) == sum(k >= 2 for k in kids)
        sibling_edges = sum(kids[n["parent"]] >= 2 for n in nodes[1:])
        assert sum("adv" in c for c in parser.classes) == sibling_edges
        assert sum("edge" in c for c in parser.classes) == len(nodes) - 1
    # the hostile observation of the shown leaf is on the page as text, not as markup
    assert not parser.injected
    assert "&lt;/script&gt;&lt;script&gt;window.PWNED=1" in dom


def test_screenshot_shows_coloured_tree(chromium, page, tmp_path):
    from PIL import Image

    path, logged = page
    png = tmp_path / "view.png"
    run_chromium(chromium, tmp_path, path.as_uri(), f"--screenshot={png}")
    assert png.exists(), "chromium wrote no screenshot"
    if os.environ.get("BPO_ARTIFACTS"):
        dest = Path(os.environ["BPO_ARTIFACTS"]) / "view.png"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(png, dest)
        print(f"screenshot: {dest}")
    print(f"screenshot: {png}")
    img = np.asarray(Image.open(png).convert("RGB")).astype(int)  # [H, W, 3]
    assert img.shape[:2] == (900, 1400)
    colours = {tuple(c) for c in img.reshape(-1, 3)[::7]}
    assert len(colours) > 200, f"only {len(colours)} distinct colours: a blank page?"

    def present(rgb: tuple[int, int, int], min_px: int = 40) -> int:
        return int((np.abs(img - np.array(rgb)).sum(axis=2) <= 6).sum())

    shown = logged[-2]["nodes"]
    returns = {0.0: (215, 48, 39), 1.0: (26, 152, 80)}  # ends of the leaf-return scale
    leaf_rets = {_path_return(shown, i) for i in range(len(shown)) if _is_leaf(shown, i)}
    for r in leaf_rets:
        assert present(returns[r]) >= 40, f"no leaf drawn in the colour of return {r}"
    assert present((229, 231, 235)) >= 20, "no single-child node drawn"


def _is_leaf(nodes: list[dict], i: int) -> bool:
    return all(n["parent"] != i for n in nodes)


def _path_return(nodes: list[dict], i: int) -> float:
    total = 0.0
    while i > 0:
        total += nodes[i]["turn"]["reward"]
        i = nodes[i]["parent"]
    return total


# -- the page source and the command -----------------------------------------------------------
def test_page_is_self_contained_and_escapes_text(tmp_path):
    make_run(tmp_path / "run", iterations=1)
    text = build_html(tmp_path / "run")
    assert "</script><script>window.PWNED" not in text
    assert '<b id="inj">' not in text
    assert "\\u003c/script\\u003e" in text
    for remote in ("http://", "https://", "//cdn"):
        assert remote not in text.replace("http://www.w3.org/2000/svg", "")
    assert text.count("data:image/png;base64,") == 7  # the report's figures


def test_command_options(tmp_path, capsys):
    logged = make_run(tmp_path / "run", iterations=4, per_iter=3)
    out = tmp_path / "one.html"
    assert cli_main(["view", str(tmp_path / "run"), "--out", str(out), "--iteration", "2"]) == 0
    data = _page_data(out)
    assert [t["iteration"] for t in data["trees"]] == [2, 2, 2]
    assert cli_main(["view", str(tmp_path / "run"), "--out", str(out), "--max-trees", "3"]) == 0
    data = _page_data(out)
    assert [t["task"] for t in data["trees"]] == [logged[i]["task"] for i in (0, 6, 11)]
    assert cli_main(["view", str(tmp_path / "run"), "--iteration", "9"]) == 2
    assert "iterations with trees: [1, 2, 3, 4]" in capsys.readouterr().out
    assert cli_main(["view", str(tmp_path / "nowhere")]) == 2
    assert "not a bpo run directory" in capsys.readouterr().out


def _page_data(path: Path) -> dict:
    text = path.read_text()
    start = text.index('id="bpo-data">') + len('id="bpo-data">')
    return json.loads(text[start : text.index("</script>", start)])

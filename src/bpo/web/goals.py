"""Shopping goals, their reward, and an expert that reaches reward 1 through the site.

A goal is drawn from a target product (Yao et al. 2022, WebShop, section 3.1): some of its
attributes, one value of each of its option groups and a price bound above its price, said in
natural language ("i need a machine washable cotton t-shirt, in navy blue, in size large, and
price lower than 30.00 dollars"). Any product that has the attributes and options within the
bound earns reward 1, not only the target. Train and test goals have disjoint targets.

The reward is WebShop's (their equation 1, without its fuzzy text matching):

    r = r_type * (|attributes matched| + |options matched| + 1[price <= bound])
               / (|attributes| + |options| + 1)

with r_type = 1 for the goal's product type, 0.5 for another type of its category and 0.1
otherwise. Success is r = 1.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import NamedTuple, Protocol

from bpo.web.catalog import Catalog, Product

PER_PAGE = 10
"""Products on one page of search results (WebShop's ten)."""
SPLITS = ("train", "test")
DEFAULT_TRAIN = 2000
DEFAULT_TEST = 500

_LEADS = ("i need", "i'm looking for", "find me", "i want to buy", "i am shopping for",
          "get me", "i would like")  # fmt: skip
_OPTION_PHRASES = {
    "color": "in {v}", "size": "in size {v}", "flavor": "{v} flavor", "scent": "{v} scent",
    "shade": "in the shade {v}", "count": "{v}", "pieces": "with {v}", "length": "{v} long",
    "capacity": "with a capacity of {v}", "model": "for the {v}", "weight": "weighing {v}",
    "thickness": "{v} thick",
}  # fmt: skip


@dataclass(frozen=True)
class Goal:
    """One instruction and what satisfies it."""

    id: str
    split: str
    instruction: str
    target: str
    """The product the goal was drawn from (one that scores 1; others may too)."""
    category: str
    type: str
    attributes: tuple[str, ...]
    options: tuple[tuple[str, str], ...]
    """(group, value) for each option group of the target, in the product's order."""
    price_cents: int
    """The price bound: a product at or below it satisfies the goal's price."""
    query: str
    """The search the expert types: the target's title, which ranks it first."""

    def to_json(self) -> dict:
        d = asdict(self)
        d["options"] = dict(self.options)
        d["price_upper"] = self.price_cents / 100
        return d


class Reward(NamedTuple):
    """A purchase's reward and its parts."""

    reward: float
    type_match: float
    attributes_matched: int
    options_matched: int
    price_ok: bool
    n_attributes: int
    n_options: int


def reward(goal: Goal, product: Product, chosen: Mapping[str, str]) -> Reward:
    """WebShop's reward for buying ``product`` with options ``chosen`` (group -> value)."""
    if product.type == goal.type:
        type_match = 1.0
    elif product.category == goal.category:
        type_match = 0.5
    else:
        type_match = 0.1
    attrs = sum(a in product.attributes for a in goal.attributes)
    opts = sum(chosen.get(g) == v for g, v in goal.options)
    price_ok = product.price_cents <= goal.price_cents
    total = len(goal.attributes) + len(goal.options) + 1
    r = type_match * (attrs + opts + int(price_ok)) / total
    return Reward(r, type_match, attrs, opts, price_ok, len(goal.attributes), len(goal.options))


def instruction(
    lead: str, kind: str, attributes: tuple[str, ...], options: tuple[tuple[str, str], ...],
    price_cents: int,
) -> str:  # fmt: skip
    """The goal said in words."""
    before = [a for a in attributes if not a.startswith("for ")]
    after = [a for a in attributes if a.startswith("for ")]
    noun = " ".join([*before, kind, *after])
    if kind.endswith("s") and not kind.endswith("ss"):
        article = "some"
    else:
        article = "an" if noun[0] in "aeiou" else "a"
    parts = [f"{lead} {article} {noun}"]
    parts += [_OPTION_PHRASES.get(g, "with {v}").format(v=v) for g, v in options]
    return ", ".join(parts) + f", and price lower than {price_cents / 100:.2f} dollars"


def _goal(rng: random.Random, gid: str, split: str, p: Product) -> Goal:
    attrs = tuple(sorted(rng.sample(p.attributes, rng.randint(1, min(3, len(p.attributes)))),
                         key=p.attributes.index))  # fmt: skip
    options = tuple((g, rng.choice(values)) for g, values in p.options)
    bound = math.ceil(p.price_cents * rng.uniform(1.05, 1.6) / 100) * 100
    text = instruction(rng.choice(_LEADS), p.type, attrs, options, bound)
    return Goal(gid, split, text, p.id, p.category, p.type, attrs, options, bound,
                p.title.lower().replace(",", ""))  # fmt: skip


def make_goals(
    catalog: Catalog, n_train: int = DEFAULT_TRAIN, n_test: int = DEFAULT_TEST
) -> dict[str, Goal]:
    """Goals by id (``shop-train-00042``, ``shop-test-00007``), the same for the same catalogue.

    Targets are distinct products; a catalogue with fewer products than goals asked for gets
    fewer goals, in the same train:test proportion."""
    ids = catalog.product_ids()
    if n_train + n_test > len(ids):
        n_test = max(1, len(ids) * n_test // (n_train + n_test))
        n_train = len(ids) - n_test
    rng = random.Random(f"bpo-web-goals-{catalog.n_products}-{catalog.seed}")
    targets = rng.sample(ids, n_train + n_test)
    goals: dict[str, Goal] = {}
    for split, chosen in (("train", targets[:n_train]), ("test", targets[n_train:])):
        for i, pid in enumerate(chosen):
            product = catalog.product(pid)
            assert product is not None
            gid = f"shop-{split}-{i:05d}"
            goals[gid] = _goal(rng, gid, split, product)
    return goals


class ShopView(Protocol):
    """What the expert reads of a session: the page it is on and the choices made."""

    page: str
    query: str
    page_no: int
    product: str | None
    options: Mapping[str, str]
    done: bool


def expert_action(goal: Goal, catalog: Catalog, view: ShopView) -> str | None:
    """The next action, in WebShop's language, on the way to buying the target with the goal's
    options; None when the episode is over. Works from any page, so it can take over a session
    midway (for demonstrations that branch off an agent's path)."""
    if view.done:
        return None
    if view.page == "home":
        return f"search[{goal.query}]"
    if view.page == "results":
        ids = catalog.search(view.query)
        if goal.target not in ids:
            return "click[Back to Search]"
        want = ids.index(goal.target) // PER_PAGE + 1
        if want == view.page_no:
            return f"click[{goal.target}]"
        return "click[Next >]" if want > view.page_no else "click[< Prev]"
    if view.page == "item" and view.product == goal.target:
        for group, value in goal.options:
            if view.options.get(group) != value:
                return f"click[{value}]"
        return "click[Buy Now]"
    if view.page in ("description", "features"):
        return "click[< Prev]"
    return "click[< Prev]" if view.query else "click[Back to Search]"

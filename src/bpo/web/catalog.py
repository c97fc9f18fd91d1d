"""The shop's product catalogue: a seeded generator and the SQLite file it builds.

Products are drawn from twelve category vocabularies (product types, attributes such as
"machine washable" or "gluten free", option groups such as size and colour, a price range),
in the manner of WebShop's scraped catalogue (Yao et al. 2022) but generated, so that any size
can be built offline and the same (n_products, seed) always gives the same products. The file
holds a ``products`` table and an FTS5 index (porter stemming) over title, description,
attributes and type that :meth:`Catalog.search` ranks with ``bm25()``.

Files are cached under ``$BPO_CACHE/web`` (default ``~/.cache/bpo/web``), keyed by
(generator version, n_products, seed), and built atomically (a temporary file renamed into
place), so concurrent builders of the same key are harmless.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import re
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path

GENERATOR_VERSION = 1
DEFAULT_PRODUCTS = 5000
RESULTS_LIMIT = 50
"""Search returns at most this many products (WebShop shows the top 50, ten a page)."""

# category -> price range in dollars, attributes (a tuple: pick at most one of them), option
# groups (name -> values; "name/type" overrides the values for one product type) and product
# types (type -> the option groups it may have).
CATEGORIES: dict[str, dict] = {
    "clothing": dict(
        price=(8, 90), audience=("for Men", "for Women", "Unisex", ""),
        attributes=[("cotton", "polyester", "organic cotton"), "machine washable",
                    ("slim fit", "relaxed fit", "regular fit"), "moisture wicking",
                    "wrinkle free", "stretch", "quick dry", "tagless", "breathable"],
        groups={"size": ["x-small", "small", "medium", "large", "x-large", "xx-large"],
                "color": ["black", "white", "navy blue", "heather grey", "red", "olive green",
                          "burgundy", "light blue", "charcoal", "pink"]},
        types={"t-shirt": ("size", "color"), "hoodie": ("size", "color"),
               "jeans": ("size", "color"), "dress": ("size", "color"), "socks": ("size", "color"),
               "jacket": ("size", "color"), "leggings": ("size", "color"),
               "polo shirt": ("size", "color")},
    ),
    "shoes": dict(
        price=(20, 160), audience=("for Men", "for Women", "Unisex", ""),
        attributes=["non slip", "rubber sole", ("lace up", "slip on"), "waterproof",
                    "memory foam", ("leather", "canvas", "knit upper"), "lightweight",
                    "arch support", "cushioned", "wide width"],
        groups={"size": ["6", "6.5", "7", "7.5", "8", "8.5", "9", "9.5", "10", "10.5", "11", "12"],
                "color": ["black", "white", "brown", "grey", "navy", "tan", "olive"]},
        types={"sneakers": ("size", "color"), "running shoes": ("size", "color"),
               "hiking boots": ("size", "color"), "sandals": ("size", "color"),
               "loafers": ("size", "color"), "slippers": ("size", "color"),
               "rain boots": ("size", "color")},
    ),
    "kitchen": dict(
        price=(10, 200), audience=("",),
        attributes=["dishwasher safe", "bpa free", ("stainless steel", "bamboo", "cast iron",
                    "ceramic", "glass"), "non stick", "oven safe", "easy to clean",
                    "heat resistant", "food grade", "induction compatible", "leak proof",
                    "microwave safe"],
        groups={"color": ["black", "silver", "red", "white", "teal", "copper"],
                "size": ["small", "medium", "large"],
                "capacity": ["12 oz", "16 oz", "20 oz", "32 oz", "40 oz"],
                "count": ["set of 3", "set of 5", "set of 10", "set of 12"]},
        types={"cookware set": ("color", "count"), "chef knife": ("color", "size"),
               "cutting board": ("size", "count"), "coffee maker": ("color",),
               "mixing bowls": ("color", "count"), "travel mug": ("color", "capacity"),
               "food storage containers": ("count", "color"), "kettle": ("color", "capacity")},
    ),
    "electronics accessories": dict(
        price=(6, 120), audience=("",),
        attributes=["fast charging", "water resistant", "shockproof", "tempered glass",
                    "noise cancelling", "compact", "long battery life", "braided nylon",
                    "magnetic", "bluetooth 5.3", "aluminum alloy", "wireless"],
        groups={"color": ["black", "white", "blue", "pink", "space gray", "clear", "green"],
                "model": ["iphone 14", "iphone 15", "iphone 15 pro", "galaxy s23", "galaxy s24",
                          "pixel 8"],
                "length": ["3 ft", "6 ft", "10 ft"], "count": ["1 pack", "2 pack", "3 pack"]},
        types={"phone case": ("model", "color"), "usb c cable": ("length", "color", "count"),
               "wireless charger": ("color",), "screen protector": ("model", "count"),
               "earbuds": ("color",), "power bank": ("color", "count"),
               "laptop stand": ("color",), "hdmi cable": ("length", "count")},
    ),
    "beauty": dict(
        price=(5, 70), audience=("for Women", "for Men", ""),
        attributes=["paraben free", "cruelty free", "sulfate free", "vegan", "fragrance free",
                    "hypoallergenic", "dermatologist tested", "long lasting",
                    "natural ingredients", ("for dry skin", "for oily skin", "for sensitive skin")],
        groups={"scent": ["lavender", "unscented", "coconut", "rose", "citrus", "vanilla"],
                "size": ["2 fl oz", "8 fl oz", "16 fl oz", "32 fl oz"],
                "shade": ["ruby red", "nude", "coral", "mauve", "berry", "classic red"]},
        types={"shampoo": ("scent", "size"), "conditioner": ("scent", "size"),
               "moisturizer": ("size", "scent"), "lipstick": ("shade",), "face serum": ("size",),
               "nail polish": ("shade",), "sunscreen": ("size",), "body wash": ("scent", "size")},
    ),
    "home decor": dict(
        price=(8, 250), audience=("",),
        attributes=["handmade", "fade resistant", "machine washable", "eco friendly",
                    "ready to hang", ("modern", "farmhouse", "boho", "mid century"),
                    ("for living room", "for bedroom"), "non slip backing", "thermal insulated"],
        groups={"color": ["beige", "grey", "navy", "sage green", "mustard yellow", "white",
                          "black", "terracotta"],
                "size": ["18x18 inch", "20x20 inch"], "size/area rug": ["3x5 ft", "5x7 ft", "8x10 ft"],
                "size/curtains": ["52x63 inch", "52x84 inch", "52x96 inch"],
                "size/picture frame": ["4x6 inch", "5x7 inch", "8x10 inch"],
                "size/wall art": ["12x16 inch", "16x24 inch", "24x36 inch"],
                "count": ["1 piece", "2 pieces", "4 pieces"]},
        types={"throw pillow covers": ("size", "color", "count"), "wall art": ("size", "count"),
               "area rug": ("size", "color"), "curtains": ("size", "color", "count"),
               "scented candle": ("count",), "picture frame": ("size", "color", "count"),
               "vase": ("color",), "table lamp": ("color",)},
    ),
    "grocery": dict(
        price=(4, 60), audience=("",),
        attributes=["gluten free", "organic", "non gmo", "keto friendly",
                    ("low sugar", "sugar free"), "high protein", "kosher", "plant based",
                    "dairy free", "whole grain", "no artificial flavors", "individually wrapped"],
        groups={"flavor": ["chocolate", "vanilla", "peanut butter", "sea salt", "original",
                           "honey", "mixed berry", "cinnamon"],
                "count": ["pack of 6", "pack of 12", "pack of 24"],
                "size": ["8 ounce", "1 pound", "2 pound", "5 pound"]},
        types={"coffee beans": ("size", "flavor"), "protein bars": ("flavor", "count"),
               "green tea": ("count", "flavor"), "snack mix": ("flavor", "count"),
               "pasta": ("count", "size"), "olive oil": ("size",),
               "granola": ("flavor", "size"), "nut butter": ("flavor", "size")},
    ),
    "toys": dict(
        price=(8, 120), audience=("for Kids", "for Toddlers", ""),
        attributes=[("for ages 3 and up", "for ages 8 and up", "for ages 12 and up"),
                    "educational", "battery operated", "non toxic", "stem", "soft",
                    "interactive", "durable", "rechargeable", "easy to assemble"],
        groups={"color": ["red", "blue", "pink", "green", "yellow", "purple"],
                "pieces": ["100 pieces", "300 pieces", "500 pieces", "1000 pieces"],
                "size": ["small", "medium", "large"]},
        types={"building blocks": ("pieces", "color"), "jigsaw puzzle": ("pieces",),
               "plush toy": ("size", "color"), "remote control car": ("color",),
               "board game": (), "dollhouse": ("size",), "art kit": ("pieces",),
               "water gun": ("color", "size")},
    ),
    "sports": dict(
        price=(8, 250), audience=("", "for Men", "for Women"),
        attributes=["non slip", "lightweight", "adjustable", "durable", "portable",
                    "sweat resistant", "extra thick", "foldable", "anti burst", "waterproof",
                    "high density"],
        groups={"color": ["black", "blue", "purple", "pink", "green", "grey", "orange"],
                "weight": ["5 lb", "10 lb", "15 lb", "20 lb", "25 lb"],
                "thickness": ["1/4 inch", "1/2 inch", "1 inch"],
                "size": ["small", "medium", "large", "x-large"]},
        types={"yoga mat": ("color", "thickness"), "dumbbells": ("weight", "color"),
               "resistance bands": ("color", "weight"), "jump rope": ("color",),
               "tennis racket": ("color",), "camping tent": ("size", "color"),
               "foam roller": ("color", "size"), "cycling gloves": ("size", "color")},
    ),
    "office": dict(
        price=(3, 300), audience=("",),
        attributes=["refillable", "ergonomic", "acid free", "quick dry ink", "heavy duty",
                    "adjustable height", "lumbar support", "recycled paper",
                    ("wide ruled", "college ruled"), "smooth writing", "bleed proof",
                    "360 swivel"],
        groups={"color": ["black", "blue", "red", "assorted colors", "white", "grey"],
                "count": ["pack of 5", "pack of 12", "pack of 24", "pack of 48"],
                "size": ["a5", "letter size", "legal size"]},
        types={"spiral notebook": ("size", "count", "color"), "gel pens": ("count", "color"),
               "desk organizer": ("color",), "office chair": ("color",),
               "stapler": ("color",), "sticky notes": ("count", "color"),
               "file folders": ("size", "count", "color"), "desk lamp": ("color",)},
    ),
    "pet supplies": dict(
        price=(6, 150), audience=("",),
        attributes=["washable", "odor control", "durable", "chew resistant",
                    ("for small dogs", "for large dogs", "for cats"), "reflective",
                    "orthopedic", "non slip", "natural ingredients", "easy to clean"],
        groups={"size": ["small", "medium", "large", "x-large"],
                "color": ["brown", "grey", "black", "blue", "pink", "beige"],
                "scent": ["unscented", "lavender", "fresh linen"]},
        types={"dog bed": ("size", "color"), "cat litter": ("scent",),
               "dog toy": ("size", "color"), "pet shampoo": ("scent",),
               "dog leash": ("color", "size"), "cat tree": ("color",),
               "pet bowl": ("size", "color")},
    ),
    "bags": dict(
        price=(12, 280), audience=("for Men", "for Women", "Unisex", ""),
        attributes=["water resistant", ("leather", "nylon", "canvas"), "lightweight",
                    "usb charging port", "anti theft", "multiple pockets", "tsa approved",
                    "rfid blocking", "padded laptop compartment", "adjustable strap"],
        groups={"color": ["black", "brown", "navy", "grey", "tan", "burgundy"],
                "size": ["13 inch", "15.6 inch", "17 inch"],
                "size/carry on luggage": ["20 inch", "24 inch", "28 inch"]},
        types={"backpack": ("color", "size"), "carry on luggage": ("size", "color"),
               "tote bag": ("color",), "duffel bag": ("color",), "laptop sleeve": ("size", "color"),
               "crossbody bag": ("color",), "wallet": ("color",)},
    ),
}  # fmt: skip

_LINES = ("Essentials", "Classic", "Pro", "Everyday", "Premium", "Basics", "Signature",
          "Urban", "Active", "Studio", "Home", "Elite", "Lite", "Max", "Original", "Select",
          "Prime", "Nova", "Heritage", "Flex")  # fmt: skip
_SYLLABLES = ("no", "var", "ki", "lo", "ze", "ra", "mi", "sto", "vel", "an", "ta", "bri", "quo",
              "del", "fi", "ro", "ca", "lu", "ne", "ox", "ar", "tem", "sol", "va", "ly", "pe",
              "dro", "ka", "mar", "zen", "tri", "bel", "gor", "hal", "is", "jun", "wex", "yor")  # fmt: skip
_UPPER = {"usb", "hdmi", "bpa", "gmo", "spf", "tsa", "rfid", "a5"}
_CLAIMS = ("Built to last and easy to care for.", "Backed by our 30-day return promise.",
           "A customer favourite for everyday use.", "Designed and tested for comfort.",
           "Makes a thoughtful gift.", "Quality you can see and feel.")  # fmt: skip


@dataclass(frozen=True)
class Product:
    """One product. ``options`` lists the option groups in display order, each with its values."""

    id: str
    title: str
    category: str
    type: str
    brand: str
    price_cents: int
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]
    description: str
    features: tuple[str, ...]

    @property
    def price(self) -> str:
        return f"${self.price_cents // 100}.{self.price_cents % 100:02d}"

    def group(self, name: str) -> tuple[str, ...]:
        return dict(self.options).get(name, ())


def _cap(words: str) -> str:
    return " ".join(
        w.upper() if w in _UPPER else "-".join(p[:1].upper() + p[1:] for p in w.split("-"))
        for w in words.split()
    )


def _attributes(rng: random.Random, vocab: list, k: int) -> tuple[str, ...]:
    slots = rng.sample(range(len(vocab)), k)
    return tuple(
        rng.choice(vocab[i]) if isinstance(vocab[i], tuple) else vocab[i] for i in sorted(slots)
    )


def generate(n_products: int = DEFAULT_PRODUCTS, seed: int = 0) -> list[Product]:
    """The catalogue for (n_products, seed): the same list on every machine and run."""
    rng = random.Random(f"bpo-web-catalog-v{GENERATOR_VERSION}-{seed}")
    brands = sorted({
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 2, 3)))).capitalize()
        for _ in range(300)
    })  # fmt: skip
    names = sorted(CATEGORIES)
    products: list[Product] = []
    ids: set[str] = set()
    titles: set[str] = set()
    alphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    while len(products) < n_products:
        cat_name = names[len(products) % len(names)]
        cat = CATEGORIES[cat_name]
        kind = rng.choice(sorted(cat["types"]))
        attrs = _attributes(rng, cat["attributes"], rng.randint(2, 5))
        allowed = cat["types"][kind]
        n_groups = min(len(allowed), rng.choice((0, 1, 1, 2, 2, 2, 3, 3)))
        options: list[tuple[str, tuple[str, ...]]] = []
        seen: set[str] = set()
        for g in sorted(rng.sample(allowed, n_groups), key=allowed.index):
            vocab = cat["groups"].get(f"{g}/{kind}", cat["groups"][g])
            pick = set(rng.sample(vocab, rng.randint(2, min(6, len(vocab)))))
            values = tuple(v for v in vocab if v in pick)
            if seen.isdisjoint(values):  # one option's text names one option on the page
                options.append((g, values))
                seen.update(values)
        brand = rng.choice(brands)
        line = rng.choice(_LINES)
        front = [
            a for a in attrs if not a.startswith("for ") and not set(a.split()) & set(kind.split())
        ]
        shown = rng.sample(front, min(len(front), rng.randint(1, 2))) if front else []
        audience = rng.choice(cat["audience"])
        title = " ".join(x for x in (brand, line, _cap(" ".join(shown)), _cap(kind), audience) if x)
        rest = [a for a in front if a not in shown]
        if rest and rng.random() < 0.6:
            title += ", " + _cap(rest[0])
        if title in titles:
            continue
        lo, hi = cat["price"]
        dollars = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        cents = rng.choice((99, 99, 49, 95, 0, rng.randint(0, 99)))
        pid = "B0" + "".join(rng.choice(alphabet) for _ in range(8))
        if pid in ids:
            continue
        described = ", ".join(attrs[:-1]) + f" and {attrs[-1]}" if len(attrs) > 1 else attrs[0]
        description = (
            f"The {brand} {line} {kind} is {described}. "
            f"{rng.choice(_CLAIMS)} "
            + (f"Available in {len(options[0][1])} {options[0][0]} options. " if options else "")
            + f"Part of our {cat_name} range."
        )
        features = tuple(f"{_cap(a)}: {rng.choice(_CLAIMS)}" for a in attrs)
        ids.add(pid)
        titles.add(title)
        products.append(Product(pid, title, cat_name, kind, brand, max(100, dollars * 100 + cents),
                                attrs, tuple(options), description, features))  # fmt: skip
    return products


# -- the SQLite file -----------------------------------------------------------------------------
_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE products (
    rowid INTEGER PRIMARY KEY, id TEXT UNIQUE NOT NULL, title TEXT NOT NULL,
    category TEXT NOT NULL, type TEXT NOT NULL, brand TEXT NOT NULL, price_cents INTEGER NOT NULL,
    attributes TEXT NOT NULL, options TEXT NOT NULL, description TEXT NOT NULL,
    features TEXT NOT NULL, title_key TEXT NOT NULL);
CREATE INDEX products_title_key ON products (title_key);
CREATE VIRTUAL TABLE products_fts USING fts5(
    title, description, attributes, type, options, tokenize = 'porter unicode61');
"""
_BM25_WEIGHTS = (10.0, 1.0, 4.0, 6.0, 2.0)  # title, description, attributes, type, options
_STOPWORDS = frozenset((
    "a", "an", "the", "and", "or", "i", "im", "me", "my", "need", "want", "wants", "looking",
    "look", "find", "buy", "get", "can", "you", "am", "is", "some", "please", "with", "of", "to",
    "in", "on", "price", "lower", "than", "less", "under", "dollars", "dollar",
))  # fmt: skip


def _words(text: str) -> list[str]:
    return re.findall(r"[^\W_]+", text.lower())


def title_key(text: str) -> str:
    """A title or query reduced to its words, for the exact-title match that ranks first."""
    return " ".join(_words(text))


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``cache_dir``, or ``$BPO_CACHE/web`` (default ``~/.cache/bpo/web``)."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("BPO_CACHE", "~/.cache/bpo")).expanduser() / "web"


def build(
    n_products: int = DEFAULT_PRODUCTS,
    seed: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """The catalogue file for (n_products, seed), built on first use and cached."""
    if n_products < 1:
        raise ValueError(f"n_products must be at least 1, not {n_products}")
    root = cache_root(cache_dir) / f"v{GENERATOR_VERSION}"
    path = root / f"shop-n{n_products}-s{seed}.sqlite"
    if path.exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=path.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        con = sqlite3.connect(tmp)
        with con:
            con.executescript(_SCHEMA)
            con.executemany("INSERT INTO meta VALUES (?, ?)", [
                ("generator_version", str(GENERATOR_VERSION)), ("n_products", str(n_products)),
                ("seed", str(seed))])  # fmt: skip
            products = generate(n_products, seed)
            con.executemany(f"INSERT INTO products VALUES ({', '.join('?' * 12)})", [
                (i + 1, p.id, p.title, p.category, p.type, p.brand, p.price_cents,
                 json.dumps(p.attributes), json.dumps(p.options), p.description,
                 json.dumps(p.features), title_key(p.title))
                for i, p in enumerate(products)
            ])  # fmt: skip
            con.executemany("INSERT INTO products_fts (rowid, title, description, attributes, type, options) "
                "VALUES (?, ?, ?, ?, ?, ?)", [
                (i + 1, p.title, p.description, ", ".join(p.attributes), p.type,
                 ", ".join(v for _, values in p.options for v in values))
                for i, p in enumerate(products)
            ])  # fmt: skip
            con.execute("INSERT INTO products_fts (products_fts) VALUES ('optimize')")
        con.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


class Catalog:
    """A read-only view of a built catalogue file: products by id and BM25 search."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._con = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
        meta = dict(self._con.execute("SELECT key, value FROM meta"))
        self.n_products = int(meta["n_products"])
        self.seed = int(meta["seed"])
        self.search = functools.lru_cache(maxsize=4096)(self._search)
        self.product = functools.lru_cache(maxsize=8192)(self._product)

    @classmethod
    def open(
        cls, n_products: int = DEFAULT_PRODUCTS, seed: int = 0,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> Catalog:  # fmt: skip
        return cls(build(n_products, seed, cache_dir))

    def __len__(self) -> int:
        return self.n_products

    def _product(self, pid: str) -> Product | None:
        row = self._con.execute(
            "SELECT id, title, category, type, brand, price_cents, attributes, options, "
            "description, features FROM products WHERE id = ?",
            (pid,),
        ).fetchone()
        if row is None:
            return None
        attrs, opts, feats = (json.loads(x) for x in (row[6], row[7], row[9]))
        return Product(*row[:6], tuple(attrs), tuple((g, tuple(v)) for g, v in opts),
                       row[8], tuple(feats))  # fmt: skip

    def product_ids(self) -> list[str]:
        """Every product id, in catalogue order."""
        return [r[0] for r in self._con.execute("SELECT id FROM products ORDER BY rowid")]

    def _search(self, query: str) -> tuple[str, ...]:
        """Product ids for ``query``, best first (at most RESULTS_LIMIT): a product whose title
        is exactly the query comes first, then BM25 over any of the query's words."""
        words = [w for w in _words(query[:1000]) if w not in _STOPWORDS][:32]
        if not words:
            return ()
        match = " OR ".join(f'"{w}"' for w in dict.fromkeys(words))
        weights = ", ".join(map(str, _BM25_WEIGHTS))
        ranked = [r[0] for r in self._con.execute(
            "SELECT p.id FROM (SELECT rowid, bm25(products_fts, "
            f"{weights}) AS score FROM products_fts WHERE products_fts MATCH ? "
            "ORDER BY score, rowid LIMIT ?) AS f JOIN products p ON p.rowid = f.rowid "
            "ORDER BY f.score, f.rowid",
            (match, RESULTS_LIMIT),
        )]  # fmt: skip
        exact = [r[0] for r in self._con.execute(
            "SELECT id FROM products WHERE title_key = ? ORDER BY rowid", (title_key(query),))]  # fmt: skip
        return tuple(dict.fromkeys(exact + ranked))[:RESULTS_LIMIT]

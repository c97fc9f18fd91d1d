"""Property tests of the config loader (bpo.config.load_config).

Contract: whatever the override strings or the YAML file hold, ``load_config`` either returns a
:class:`~bpo.config.Config` or raises :class:`~bpo.config.ConfigError` with a message; never
another exception. A config that loads can also be written back as YAML and reloads to the same
config (``bpo train`` writes ``to_dict(cfg)`` to the run's config.yaml and ``--resume`` reads it).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bpo.config import Config, ConfigError, load_config, to_dict

SETTINGS = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _dotted_keys() -> list[str]:
    """Every valid dotted key, the section names and the ``options`` sub-keys' parents."""
    keys: list[str] = []
    defaults = Config()
    for section in dataclasses.fields(Config):
        keys.append(section.name)
        for f in dataclasses.fields(getattr(defaults, section.name)):
            keys.append(f"{section.name}.{f.name}")
    keys += ["sandbox.options.level", "tree.options.quantile", "estimator.options.eps"]
    return keys


VALID_KEYS = _dotted_keys()
NUMBERS = ["1", "-3", "0", "3.5", "1e400", "1.0e+400", "-.inf", ".nan"]
WORDS = ["true", "no", "null", "~", "rloo", "every", "hf"]
DATES = ["2001-12-14", "2001-13-45", "2001-02-30 25:61:61"]  # the last two: invalid dates
COLLECTIONS = ["[1, 2]", "[0.9, 0.95]", "[]", "{}", "{a: [1, {b: 2}]}", "- 1\n- 2", "k: v"]
BROKEN = ["", "'unterminated", "[1, 2", "{a: 1", "*undefined", "\x00", "\t"]
TAGS = ["!!binary aGVsbG8=", "!!binary %%%", "!!python/name:os.system", "!!set {a, b}", "&a [*a]"]
HUGE = ["1" + "0" * 400, "9" * 5000, "[" * 3000, "{a: " * 800]
YAML_SNIPPETS = NUMBERS + WORDS + DATES + COLLECTIONS + BROKEN + TAGS + HUGE
JUNK = st.text(max_size=40)
KEY = st.one_of(
    st.sampled_from(VALID_KEYS),
    JUNK,
    st.builds(lambda k, j: f"{k}.{j}", st.sampled_from(VALID_KEYS), JUNK),
    st.lists(st.sampled_from(["tree", "k", "options", "", " ", "run", "x"]), max_size=5).map(
        ".".join
    ),
)
VALUE = st.one_of(
    st.sampled_from(YAML_SNIPPETS), JUNK, st.integers().map(str), st.floats().map(str)
)
OVERRIDE = st.one_of(st.builds(lambda k, v: f"{k}={v}", KEY, VALUE), JUNK)


def _load_or_config_error(path: Path | None, overrides: list[str]) -> Config | None:
    """The loaded config, or None after a ConfigError with a message; anything else fails."""
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        assert str(e).strip(), "a ConfigError must say what is wrong"
        return None
    assert isinstance(cfg, Config)
    return cfg


def _assert_round_trip(cfg: Config) -> None:
    """What ``bpo train`` does with a loaded config: write it as YAML, read it back."""
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "config.yaml"
        p.write_text(text)
        again = load_config(p)
    assert _same(to_dict(again), to_dict(cfg)), (to_dict(again), to_dict(cfg))


def _same(a: object, b: object) -> bool:
    """Equality that counts NaN as equal to NaN (YAML writes and reads it back as .nan)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@SETTINGS
@given(st.lists(OVERRIDE, max_size=4))
@example(["run.seed=2001-13-45"])  # YAML timestamps: datetime raises ValueError
@example(["sandbox.options.when=2001-02-30"])
@example(["tree.options=" + "[" * 3000])  # PyYAML recurses: RecursionError
@example(["learner.lr=1" + "0" * 400])  # float(int) overflows: OverflowError
@example(["budget.amount=" + "9" * 5000])  # int parsing past 4300 digits: ValueError
@example(["sandbox.options.x=&a [*a]"])  # loads, but the run's config.yaml can't be written
def test_overrides_load_or_raise_config_error(overrides):
    cfg = _load_or_config_error(None, overrides)
    if cfg is not None:
        _assert_round_trip(cfg)


SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=20),
    st.dates(),
    st.binary(max_size=8),
)
FIELD_NAMES = sorted({k.split(".")[-1] for k in VALID_KEYS})
MAP_KEY = st.one_of(
    st.sampled_from(FIELD_NAMES), st.text(max_size=10), st.integers(), st.booleans(), st.none()
)
NESTED = st.recursive(
    SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(MAP_KEY, inner, max_size=4)
    ),
    max_leaves=12,
)
SECTION_NAMES = [f.name for f in dataclasses.fields(Config)]
TOP = st.dictionaries(
    st.one_of(st.sampled_from(SECTION_NAMES), MAP_KEY),
    st.one_of(
        st.dictionaries(st.one_of(st.sampled_from(FIELD_NAMES), MAP_KEY), NESTED, max_size=5),
        NESTED,
    ),
    max_size=5,
)


@pytest.fixture(scope="module")
def yaml_path():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d) / "config.yaml"


@SETTINGS
@given(data=TOP, overrides=st.lists(OVERRIDE, max_size=2))
def test_yaml_mappings_load_or_raise_config_error(yaml_path, data, overrides):
    yaml_path.write_text(yaml.safe_dump(data, allow_unicode=True))
    cfg = _load_or_config_error(yaml_path, overrides)
    if cfg is not None:
        _assert_round_trip(cfg)


@settings(SETTINGS, max_examples=100)
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
@example(b"\xff\xfe\x00 not utf-8")  # UnicodeDecodeError
@example(b"run:\n  seed: 2001-13-45\n")  # datetime's ValueError out of the YAML constructor
@example(b"tree:\n  options: " + b"[" * 3000)  # RecursionError in PyYAML
@example(b"- a list\n- not a mapping\n")
@example(b"")
def test_any_file_content_loads_or_raises_config_error(yaml_path, content):
    yaml_path.write_bytes(content)
    _load_or_config_error(yaml_path, [])


def test_unreadable_config_path_is_a_config_error(tmp_path):
    """A directory (or a file that cannot be read) named as the config is a ConfigError."""
    with pytest.raises(ConfigError):
        load_config(tmp_path)
    with pytest.raises(ConfigError):
        load_config(tmp_path / "missing.yaml")

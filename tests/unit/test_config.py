"""Config loading: defaults, YAML, dotted overrides, errors that name the key."""

import pytest

from bpo.config import ConfigError, load_config, to_dict


def test_defaults_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("tree:\n  k: 3\nlearner:\n  lr: 1.0e-4\n")
    cfg = load_config(
        p, ["tree.k=5", "estimator=rloo", "learner.betas=[0.9, 0.95]", "sandbox.options.level=2"]
    )
    assert cfg.tree.k == 5
    assert cfg.learner.lr == pytest.approx(1e-4)
    assert cfg.estimator.name == "rloo"
    assert cfg.learner.betas == (0.9, 0.95)
    assert cfg.sandbox.options == {"level": 2}
    assert to_dict(cfg)["tree"]["k"] == 5


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (["tree.kk=3"], r"unknown config key 'tree.kk'; valid keys here: rule, k, root_width"),
        (["tree.k=three"], "tree.k must be an integer"),
        (["estimator=ppo9"], "valid: bpo, .*gigpo, grpo, ppo, rloo"),
        (["tree.rule=entropy"], "valid: entropy_quantile"),
        (["learner.aggregation=mean"], "valid: tree, token_mean, sequence_mean"),
        (["budget.unit=flops"], "valid: tokens, steps, leaves"),
        (["tree"], "must look like key=value"),
        (["run=3"], "is a section"),
        (["nosuch.k=1"], "unknown config key 'nosuch'"),
    ],
)
def test_bad_values_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, override)


def test_missing_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tree: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


@pytest.mark.parametrize("value", [".nan", "inf", "-.inf", "1e999"])
def test_non_finite_numbers_are_rejected(value):
    with pytest.raises(ConfigError, match=r"learner\.lr must be a finite number"):
        load_config(None, [f"learner.lr={value}"])


def test_vllm_engines_as_ray_actors_take_full_weights():
    ray = ["policy.backend=vllm", "cluster.address=local", "cluster.inference_engines=2"]
    cfg = load_config(None, [*ray, "run.max_staleness=1"])
    assert cfg.cluster.inference_engines == 2
    with pytest.raises(ConfigError, match=r"needs cluster\.inference_engines > 0"):
        load_config(None, ["policy.backend=vllm", "run.max_staleness=1"])
    with pytest.raises(ConfigError, match=r"policy\.lora_rank > 0"):
        load_config(None, [*ray, "policy.lora_rank=4"])

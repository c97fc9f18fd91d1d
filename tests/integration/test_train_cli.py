"""``bpo train`` refuses bad input before any work: exit code 2, a message that names the key or
file and the fix, and nothing written. Run through the real command line in subprocesses
(started together: each one spends most of its time importing torch). Also: every config
shipped in ``configs/`` loads, the CPU ones pass the pre-flight checks, and ``bpo compare``
reads overrides on both sides of an option as ``bpo train`` does."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from bpo.config import ConfigError, load_config, to_dict

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}

# name -> (arguments after "bpo train", substrings the message must contain); in the
# arguments, OUT is the run directory to be written (it must not be), RUN an existing run
# directory (config.yaml and checkpoints/ only), NOTRUN a directory that is not a run, BERT a
# directory holding a BertConfig (an encoder, not a causal LM)
CASES: dict[str, tuple[list[str], list[str]]] = {
    "unknown key": (
        ["--out", "OUT", "run.iteratons=3"],
        ["unknown config key 'run.iteratons'", "valid keys here:", "iterations"],
    ),
    # overrides on both sides of an option all reach the config (argparse's plain parse_args
    # stops the positional list at the option and calls the rest unrecognized arguments)
    "unknown key after an option": (
        ["run.seed=1", "--out", "OUT", "run.iteratons=3"],
        ["unknown config key 'run.iteratons'", "valid keys here:"],
    ),
    "unknown section": (["--out", "OUT", "trees.k=3"], ["unknown config key 'trees'", "tree"]),
    "wrong type": (
        ["--out", "OUT", "run.iterations=many"],
        ["run.iterations must be an integer", "'many'"],
    ),
    "wrong type in a file": (
        ["--config", "BADFILE", "--out", "OUT"],
        ["tree.k must be an integer", "'four'"],
    ),
    "missing model path": (
        ["--out", "OUT", "policy.model=/nope/model"],
        ["policy.model='/nope/model'", "no such directory", "tiny"],
    ),
    "not a causal LM": (
        ["--out", "OUT", "policy.model=BERT"],
        ["'bert' model", "not a causal (decoder-only) language model", "point policy.model at"],
    ),
    "unknown sandbox": (
        ["--out", "OUT", "sandbox.name=webshopp"],
        ["sandbox.name='webshopp'", "valid names:", "alfworld", "toy", "twx"],
    ),
    "invalid rule value": (
        ["--out", "OUT", "tree.k=1"],
        ["tree (rule 'entropy_quantile', k=1", "integer >= 2"],
    ),
    "root wider than its bound": (
        ["--out", "OUT", "tree.root_width=8", "tree.max_root_width=4"],
        ["tree.max_root_width=4 is below tree.root_width=8", "tree.fill_budget=false"],
    ),
    "resume a dir that is not a run": (
        ["--resume", "NOTRUN"],
        ["--resume", "no config.yaml there, so not a bpo run directory"],
    ),
    "resume with a different config": (
        ["--resume", "RUN", "tree.k=5"],
        ["different config", "differs in tree.k", "resume without overrides"],
    ),
    "new run over an existing run": (
        ["--out", "RUN"],
        ["already holds a run", "bpo train --resume"],
    ),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, Path]]:
    from transformers import BertConfig

    base = tmp_path_factory.mktemp("cli")
    bert = base / "bert"
    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(bert)
    notrun = base / "notrun"
    notrun.mkdir()
    (notrun / "metrics.jsonl").write_text("")
    run = base / "run"  # what `bpo train --config configs/toy.yaml` leaves (its config.yaml)
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config(CONFIGS / "toy.yaml"))))
    badfile = base / "bad.yaml"
    badfile.write_text("sandbox:\n  name: toy\ntree:\n  k: four\n")
    subs = {"BERT": str(bert), "NOTRUN": str(notrun), "RUN": str(run), "BADFILE": str(badfile)}

    def one(name: str) -> tuple[int, str, Path]:
        out = base / name.replace(" ", "-")
        paths = {**subs, "OUT": str(out)}
        args = []
        for a in CASES[name][0]:
            key, eq, value = a.rpartition("=")
            args.append(key + eq + paths[value] if value in paths else a)
        if "--config" not in args and "--resume" not in args:
            args = ["--config", str(CONFIGS / "toy.yaml"), *args]
        proc = subprocess.run(
            [sys.executable, "-m", "bpo.cli", "train", *args],
            cwd=base, env=ENV, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        return proc.returncode, proc.stdout + proc.stderr, out

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(CASES, pool.map(one, CASES), strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_fails_before_any_work(name: str, results: dict) -> None:
    rc, output, out = results[name]
    assert rc == 2, output
    assert "Traceback" not in output, output
    for text in CASES[name][1]:
        assert text in output, f"{text!r} not in: {output}"
    assert not out.exists(), f"{out} was written before the input was checked"


def test_every_config_loads() -> None:
    files = sorted(CONFIGS.rglob("*.yaml"))
    names = {p.relative_to(CONFIGS).as_posix() for p in files}
    assert {
        "toy.yaml", "twx.yaml", "textworld.yaml", "alfworld.yaml", "scienceworld.yaml",
        "gpu/qwen2.5-7b-alfworld.yaml", "gpu/llama3.1-8b-alfworld.yaml",
        "gpu/qwen2.5-7b-web.yaml", "gpu/qwen2.5-7b-code.yaml",
    } <= names  # fmt: skip
    for path in files:
        text = path.read_text()
        assert text.startswith("# "), f"{path}: starts with a header comment saying what it is"
        assert "Machine:" in text, f"{path}: the header says what machine it needs"
        load_config(path)


def test_cpu_configs_pass_preflight() -> None:
    """Registered sandbox, valid rule and estimator options, a buildable model: everything
    but running the engines (the sandbox options are checked when a run starts)."""
    from bpo.train import preflight

    cpu = sorted(CONFIGS.glob("*.yaml"))
    assert cpu
    for path in cpu:
        preflight(load_config(path))
    gpu = load_config(CONFIGS / "gpu" / "qwen2.5-7b-alfworld.yaml")
    with pytest.raises(ConfigError, match=r"policy\.backend='vllm'"):
        preflight(gpu)  # the main venv has no vLLM (it lives in .venv-vllm: make setup-vllm)


def test_compare_reads_overrides_on_both_sides_of_an_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bpo import compare

    out = tmp_path / "cmp"
    argv = ["--quick", "run.seed=1", "--out", str(out), "run.iteratons=3"]
    assert compare.main(argv) == 2
    assert "unknown config key 'run.iteratons'" in capsys.readouterr().out
    assert not out.exists()

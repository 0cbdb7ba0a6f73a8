"""Small local copies of the hub datasets, in the exact hub schema and repository layout.

Each writer creates ``<root>/<hub_id>/...`` with the same file names, split names, column names, nesting and dtypes
as the hub repository (taken from each dataset card's ``dataset_info``), so ``paths.datasets_dir=<root>`` makes the
real loaders read them through the same ``datasets.load_dataset`` call they use for the hub. Parquet repositories
also get the card's ``configs`` block, which is how the hub maps files to splits.

The rows are invented but shaped like the real ones (multi-turn transcripts, a redundant Tulu prompt column,
RewardBench subsets, a RewardBench 2 Ties row with two correct answers, HelpSteer2 multi-turn prompts).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

MESSAGES = None  # set lazily (datasets import is slow)


def _features():
    from datasets import Features, List, Value

    message_list = List({"content": Value("string"), "role": Value("string")})
    return {
        "ultrafeedback": Features({"chosen": message_list, "rejected": message_list,
                                   "score_chosen": Value("float64"), "score_rejected": Value("float64")}),
        "skywork": Features({"chosen": message_list, "rejected": message_list, "source": Value("string")}),
        "tulu": Features({"id": Value("string"), "prompt": Value("string"), "chosen": message_list,
                          "rejected": message_list, "source": Value("string")}),
        "reward_bench": Features({"prompt": Value("string"), "chosen": Value("string"),
                                  "chosen_model": Value("string"), "rejected": Value("string"),
                                  "rejected_model": Value("string"), "subset": Value("string"),
                                  "id": Value("int64")}),
        "reward_bench2": Features({
            "id": Value("string"), "prompt": Value("string"), "chosen": List(Value("string")),
            "rejected": List(Value("string")), "num_correct": Value("int64"), "num_incorrect": Value("int64"),
            "total_completions": Value("int64"), "models": List(Value("string")), "subset": Value("string"),
            "additional_metadata": {
                "category": Value("string"), "correct": Value("string"), "index": Value("float64"),
                "instruction_id_list": List(Value("string")), "label": Value("string"),
                "method": Value("string"), "models": List(Value("string")), "prompt_norm": Value("string"),
                "subcategory": Value("string"), "valid": Value("float64")},
        }),
    }


def _parquet_repo(root: Path, hub_id: str, splits: dict[str, list[dict]], features) -> Path:
    from datasets import Dataset

    repo = root / hub_id
    (repo / "data").mkdir(parents=True, exist_ok=True)
    configs = "".join(f"  - split: {s}\n    path: data/{s}-*\n" for s in splits)
    (repo / "README.md").write_text(f"---\nconfigs:\n- config_name: default\n  data_files:\n{configs}---\n")
    for split, rows in splits.items():
        Dataset.from_list(rows, features=features).to_parquet(str(repo / "data" / f"{split}-00000-of-00001.parquet"))
    return repo


def _jsonl_gz(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def msg(role: str, content: str) -> dict:
    return {"content": content, "role": role}  # hub order of the struct fields


def conversation_pairs(n: int, offset: int = 0) -> list[tuple[str, str, str]]:
    topics = ["rivers", "prime numbers", "bread", "the moon", "chess", "volcanoes", "tea", "bridges"]
    out = []
    for i in range(offset, offset + n):
        t = topics[i % len(topics)]
        out.append((f"Tell me something about {t} ({i}).",
                    f"Here is a careful, correct answer about {t}: it is interesting for reason {i}.",
                    f"I don't know much about {t}."))
    return out


def write_ultrafeedback(root: Path) -> Path:
    feats = _features()["ultrafeedback"]

    def rows(n, offset):
        return [{"chosen": [msg("user", p), msg("assistant", c)], "rejected": [msg("user", p), msg("assistant", r)],
                 "score_chosen": 8.0, "score_rejected": 4.5} for p, c, r in conversation_pairs(n, offset)]

    return _parquet_repo(root, "trl-lib/ultrafeedback_binarized", {"train": rows(40, 0), "test": rows(12, 100)},
                         feats)


def write_skywork(root: Path) -> Path:
    feats = _features()["skywork"]
    sources = ["magpie_ultra", "wildguard", "offsetbias"]
    rows = [{"chosen": [msg("user", p), msg("assistant", c)], "rejected": [msg("user", p), msg("assistant", r)],
             "source": sources[i % 3]} for i, (p, c, r) in enumerate(conversation_pairs(12))]
    return _parquet_repo(root, "Skywork/Skywork-Reward-Preference-80K-v0.2", {"train": rows}, feats)


def write_tulu(root: Path) -> Path:
    """chosen/rejected hold the user turn AND the prompt column repeats it (the layout that trips the reference)."""
    feats = _features()["tulu"]
    rows = [{"id": f"tulu-{i}", "prompt": p, "chosen": [msg("user", p), msg("assistant", c)],
             "rejected": [msg("user", p), msg("assistant", r)], "source": "ai2-adapt-dev/tulu_v3.9_wildchat"}
            for i, (p, c, r) in enumerate(conversation_pairs(10))]
    # a multi-turn pair: the shared turns (user, assistant, user) are the prompt; the prompt column is the first turn
    rows.append({"id": "tulu-multi", "prompt": "Hi!", "source": "allenai/tulu-3-sft-reused-on-policy-8b",
                 "chosen": [msg("user", "Hi!"), msg("assistant", "Hello."), msg("user", "Name a colour."),
                            msg("assistant", "Blue.")],
                 "rejected": [msg("user", "Hi!"), msg("assistant", "Hello."), msg("user", "Name a colour."),
                              msg("assistant", "Seven.")]})
    return _parquet_repo(root, "allenai/llama-3.1-tulu-3-8b-preference-mixture", {"train": rows}, feats)


REWARD_BENCH_SUBSETS = ["alpacaeval-easy", "mt-bench-hard", "llmbar-natural", "xstest-should-respond", "donotanswer",
                        "math-prm", "hep-python", "hep-go"]


def write_reward_bench(root: Path) -> Path:
    feats = _features()["reward_bench"]

    def rows(n, offset):
        out = []
        for i, (p, c, r) in enumerate(conversation_pairs(n, offset)):
            out.append({"prompt": p, "chosen": c, "chosen_model": "gpt-4", "rejected": r,
                        "rejected_model": "llama-2-7b-chat", "subset": REWARD_BENCH_SUBSETS[i % 8],
                        "id": 1000 + offset + i})
        return out

    return _parquet_repo(root, "allenai/reward-bench", {"raw": rows(24, 0), "filtered": rows(16, 0)}, feats)


def write_reward_bench2(root: Path) -> Path:
    feats = _features()["reward_bench2"]
    meta = {"category": None, "correct": None, "index": None, "instruction_id_list": [], "label": None,
            "method": None, "models": [], "prompt_norm": None, "subcategory": None, "valid": None}
    subsets = ["Factuality", "Precise IF", "Math", "Safety", "Focus"]
    rows = []
    for i, (p, c, r) in enumerate(conversation_pairs(10)):
        rows.append({"id": str(i), "prompt": p, "chosen": [c], "rejected": [r, r + " Maybe.", "No idea."],
                     "num_correct": 1, "num_incorrect": 3, "total_completions": 4,
                     "models": ["m1", "m2", "m3", "m4"], "subset": subsets[i % 5], "additional_metadata": meta})
    # Ties: the same question once with one correct answer ("ref:<n>") and once with several ("tied:<n>").
    rows.append({"id": "ref:0", "prompt": "Name the colour of a clear daytime sky.", "chosen": ["Blue."],
                 "rejected": ["Brown.", "Pink.", "Black."], "num_correct": 1, "num_incorrect": 3,
                 "total_completions": 4, "models": [], "subset": "Ties", "additional_metadata": meta})
    rows.append({"id": "tied:0", "prompt": "Name a colour of the rainbow.", "chosen": ["Red.", "Green.", "Blue."],
                 "rejected": ["Brown.", "Pink."], "num_correct": 3, "num_incorrect": 2, "total_completions": 5,
                 "models": [], "subset": "Ties", "additional_metadata": meta})
    return _parquet_repo(root, "allenai/reward-bench-2", {"test": rows}, feats)


def write_helpsteer2(root: Path) -> Path:
    repo = root / "nvidia/HelpSteer2"

    def rows(n, offset):
        out = []
        for i, (p, c, _) in enumerate(conversation_pairs(n, offset)):
            out.append({"prompt": p, "response": c, "helpfulness": i % 5, "correctness": (i + 1) % 5,
                        "coherence": 4, "complexity": 2, "verbosity": (i + 2) % 5})
        return out

    train = rows(8, 0)
    # multi-turn prompt as stored on the hub: earlier turns separated by <extra_id_1> role markers
    train.append({"prompt": "What is 2+2?\n<extra_id_1>Assistant\n4\n<extra_id_1>User\nAnd times 3?",
                  "response": "12.", "helpfulness": 4, "correctness": 4, "coherence": 4, "complexity": 1,
                  "verbosity": 1})
    _jsonl_gz(repo / "train.jsonl.gz", train)
    _jsonl_gz(repo / "validation.jsonl.gz", rows(4, 50))
    return repo


HH_SUBSETS = ("harmless-base", "helpful-base", "helpful-online", "helpful-rejection-sampled")


def write_hh_rlhf(root: Path) -> Path:
    repo = root / "Anthropic/hh-rlhf"
    for k, subset in enumerate(HH_SUBSETS):
        for split, n in (("train", 6), ("test", 3)):
            rows = []
            for i, (p, c, r) in enumerate(conversation_pairs(n, 10 * k)):
                shared = f"\n\nHuman: {p}\n\nAssistant: Sure.\n\nHuman: Go on." if i % 2 else f"\n\nHuman: {p}"
                rows.append({"chosen": f"{shared}\n\nAssistant: {c}", "rejected": f"{shared}\n\nAssistant: {r}"})
            if split == "train" and subset == "harmless-base":
                rows.append({"chosen": "no transcript markers here", "rejected": "\n\nHuman: hi\n\nAssistant: x"})
            _jsonl_gz(repo / subset / f"{split}.jsonl.gz", rows)
    # red-team-attempts has another schema and no train/test files; it must not be picked up
    _jsonl_gz(repo / "red-team-attempts" / "red_team_attempts.jsonl.gz",
              [{"transcript": "\n\nHuman: x\n\nAssistant: y", "min_harmlessness_score_transcript": 0.1}])
    return repo


WRITERS = {
    "ultrafeedback": write_ultrafeedback,
    "skywork_pref": write_skywork,
    "tulu3_pref": write_tulu,
    "reward_bench": write_reward_bench,
    "reward_bench2": write_reward_bench2,
    "helpsteer2": write_helpsteer2,
    "hh_rlhf": write_hh_rlhf,
}


def write_all(root: Path) -> Path:
    for write in WRITERS.values():
        write(root)
    return root

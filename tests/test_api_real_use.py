"""The Python API where researchers use it: inside an RL loop (TRL's GRPO, several processes, days of scoring), on
over-long samples, with moved checkpoints, and under bad input."""

import json
import shutil
import textwrap
import types

import numpy as np
import pytest
import torch
from tolerances import OTHER_BATCHES, OTHER_BATCHES_APPROX

import rewarduq_exp as r
from rewarduq_exp.api import fit_to_length
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.models.backbone import Backbone
from rewarduq_exp.models.memory_features import MemoryFeatures

FEATURE_METHODS = ("bay_lin", "ens_mlp")


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory, shared_cache):
    """One small BAY-LIN and one small ENS-MLP run (the two methods that read features from the backbone)."""
    from test_cli import NO_FIGURES, run

    cwd = tmp_path_factory.mktemp("api_real_use")
    dirs = {}
    for method in FEATURE_METHODS:
        dirs[method] = cwd / "outputs" / "runs" / method
        run("train.py", [f"method={method}", "progress=false", "dataset.n_train=96", "dataset.n_eval=16",
                         "dataset.n_ood=8", "eval_datasets=[]", *NO_FIGURES, f"hydra.run.dir={dirs[method]}"],
            cwd, shared_cache)
    return dirs


@pytest.fixture(scope="module")
def texts():
    frame = SyntheticWorld(n_train=8, n_eval=12, n_ood=8).load("eval")
    return tuple([m[0]["content"] for m in frame[col]] for col in ("prompt", "chosen", "rejected"))


@pytest.fixture(scope="module")
def model(run_dirs):
    return r.load_run(run_dirs["bay_lin"], progress=False)


# ---------------------------------------------------------------------------------------------------- item 1
SCORE_EACH_RANK = """
import json, os, sys
import torch.distributed as dist
from accelerate import PartialState
import rewarduq_exp as r

PartialState(cpu=True)  # what TRL's trainer sets up under torchrun / accelerate launch: one gloo group
rank = dist.get_rank()
texts = json.loads(open(sys.argv[2]).read())[rank]
table = r.load_run(sys.argv[1], device="cpu", progress=False).score(texts["prompts"], texts["completions"])
open(f"{sys.argv[3]}/rank{rank}.json", "w").write(table.to_json(orient="records"))
dist.barrier()
"""


@pytest.mark.parametrize("method", FEATURE_METHODS)
def test_api_scoring_is_local_to_each_process_under_torch_distributed(method, run_dirs, texts, tmp_path):
    # GRPO on 2 processes: each scores its own completions (3 and 2 of them here), at its own pace. Before, ENS-MLP
    # and BAY-LIN went through the run's sharded feature cache: rank 0 got 2 rows for 3 texts, rank 1 crashed.
    from entry_points import run_ranks

    prompts, chosen, rejected = texts
    per_rank = [{"prompts": prompts[:3], "completions": chosen[:3]},
                {"prompts": prompts[3:5], "completions": rejected[3:5]}]
    (tmp_path / "texts.json").write_text(json.dumps(per_rank))
    script = tmp_path / "score_each_rank.py"
    script.write_text(textwrap.dedent(SCORE_EACH_RANK))
    proc = run_ranks(script, [run_dirs[method], tmp_path / "texts.json", tmp_path], tmp_path, nprocs=2)
    assert proc.returncode == 0, proc.stderr[-3000:]

    single = r.load_run(run_dirs[method], device="cpu", progress=False)
    for rank, texts_of_rank in enumerate(per_rank):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        expected = single.score(texts_of_rank["prompts"], texts_of_rank["completions"])
        assert len(got) == len(expected)
        np.testing.assert_allclose([row["reward"] for row in got], expected.reward, atol=1e-6)
        np.testing.assert_allclose([row["uncertainty"] for row in got], expected.uncertainty, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- item 3
def test_over_long_completions_are_refused_in_one_line_or_truncated_on_request(run_dirs, texts):
    prompts, chosen, _ = texts
    long_completion = " ".join(chosen[:8]) * 8
    strict = r.load_run(run_dirs["bay_lin"], max_length=64, progress=False)
    with pytest.raises(r.UserError, match=r"1 of 2 conversations render to more than max_length=64 .*truncation=True"):
        strict.score(prompts[:2], [chosen[0], long_completion])

    cutting = r.load_run(run_dirs["bay_lin"], max_length=64, truncation=True, progress=False)
    table = cutting.score(prompts[:2], [chosen[0], long_completion])
    assert np.isfinite(table.to_numpy()).all()
    # the short one is untouched; the long one is scored as its completion cut to fit, template end kept
    # (here and below: the same text scored in another batch)
    np.testing.assert_allclose(table.reward[0], strict.score(prompts[:1], chosen[:1]).reward[0], **OTHER_BATCHES)
    tok = cutting.tokenizer
    user = [[{"role": "user", "content": prompts[1]}]]
    (cut,) = fit_to_length(tok, user, [[{"role": "assistant", "content": long_completion}]], 64, truncate=True)
    rendered = tok.apply_chat_template(user[0] + cut, tokenize=False)
    assert len(tok(rendered, add_special_tokens=False)["input_ids"]) <= 64
    assert long_completion.startswith(cut[0]["content"].strip()) and len(cut[0]["content"]) < len(long_completion)
    assert rendered.rstrip().endswith("<|im_end|>")
    np.testing.assert_allclose(table.reward[1], strict.score(prompts[1:2], [cut]).reward[0], **OTHER_BATCHES)


def test_a_moved_backbone_is_pointed_at_and_a_missing_one_fails_at_load(run_dirs, texts, model, tmp_path,
                                                                         tiny_backbone):
    prompts, chosen, _ = texts
    moved = tmp_path / "moved-backbone"
    shutil.copytree(tiny_backbone.source, moved)
    at_new_place = r.load_run(run_dirs["bay_lin"], backbone_path=moved, progress=False)
    # the same texts in the same batches on the same device: the same kernels, the same numbers
    np.testing.assert_allclose(at_new_place.score(prompts, chosen).reward, model.score(prompts, chosen).reward,
                               atol=1e-6)
    gone = tmp_path / "gone"
    with pytest.raises(r.UserError, match=f"not at {gone} .*backbone_path") as error:
        r.load_run(run_dirs["bay_lin"], backbone_path=gone, progress=False)
    assert "\n" not in str(error.value) and "huggingface" not in str(error.value)


def test_batch_size_and_dtype_are_load_options(run_dirs, texts, model):
    prompts, chosen, _ = texts
    one_at_a_time = r.load_run(run_dirs["ens_mlp"], batch_size=1, dtype="float32", progress=False)
    default = r.load_run(run_dirs["ens_mlp"], progress=False)
    np.testing.assert_allclose(one_at_a_time.score(prompts, chosen).reward, default.score(prompts, chosen).reward,
                               **OTHER_BATCHES)
    assert one_at_a_time.method.encoder.max_rows == 1   # rows per forward (the token budget aside)
    with pytest.raises(r.UserError, match="model.dtype=float8 is invalid; allowed: float32, bfloat16, float16"):
        r.load_run(run_dirs["ens_mlp"], dtype="float8", progress=False)
    with pytest.raises(r.UserError, match="batch_size=0 is invalid"):
        r.load_run(run_dirs["ens_mlp"], batch_size=0, progress=False)


# ---------------------------------------------------------------------------------------------------- item 4
def test_a_score_call_renders_each_conversation_once(model, texts, monkeypatch):
    """One call renders each conversation once (its length check and its features read the same text) and each
    distinct prompt's head once, and scores each row as scoring it alone does."""
    prompts, chosen, _ = texts
    prompts = [prompts[i % 3] for i in range(len(chosen))]       # 3 distinct prompts, n completions each
    completions = [c + " once" for c in chosen]                  # new texts: no stored features
    tokenizer, renders = model.tokenizer, []
    template = tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: renders.append(1) or template(*a, **k))
    table = model.score(prompts, completions)
    assert len(renders) == len(completions) + 3
    alone = [model.score([p], [c]).reward[0] for p, c in zip(prompts, completions)]
    np.testing.assert_allclose(table.reward, alone, **OTHER_BATCHES)


def test_scoring_new_texts_writes_nothing_to_disk(run_dirs, texts, model, shared_cache):
    # An RL loop scores new completions every step for days: 20 calls once wrote 60 feature files.
    prompts, chosen, rejected = texts
    roots = (shared_cache, run_dirs["bay_lin"])
    before = {p for root in roots for p in root.rglob("*")}
    for step in range(20):
        model.score(prompts, [f"{c} step {step}" for c in chosen])
        model.score_pairs(prompts, chosen, rejected)
    assert {p for root in roots for p in root.rglob("*")} == before
    assert model.method.encoder.store.nbytes > 0  # they went to memory


def test_memory_feature_store_is_bounded_and_reuses_rows():
    row_bytes = 4 * 8
    store = MemoryFeatures(max_bytes=3 * row_bytes)
    computed = []

    def compute(rows):
        computed.append(list(rows))
        return torch.stack([torch.full((8,), float(len(texts[i]))) for i in rows])

    texts = ["a", "bb", "a"]
    feats, hit = store.lookup({"probe": 1}, texts, compute)
    assert computed == [[0, 1]] and not hit  # the repeated text is computed once
    np.testing.assert_array_equal(feats[:, 0].numpy(), [1, 2, 1])
    feats, hit = store.lookup({"probe": 1}, ["bb", "a"], compute)
    assert hit and len(computed) == 1
    store.lookup({"probe": 2}, ["a"], compute)  # another probe: another row
    store.lookup({"probe": 1}, ["cccc", "ddddd"], compute)
    assert store.nbytes <= 3 * row_bytes and len(store.rows) == 3  # the least recently used rows left


# ---------------------------------------------------------------------------------------------------- item 5
def test_user_error_is_exported_and_a_value_error():
    assert issubclass(r.UserError, ValueError)
    from rewarduq_exp.core.errors import UserError

    assert r.UserError is UserError


@pytest.mark.parametrize("call, message", [
    (lambda m, t: m.score(None, ["a"]), "prompts must be a list with one entry per text .* got None"),
    (lambda m, t: m.score(["a"], None), "completions must be a list .* got None"),
    (lambda m, t: m.reward(["a"], ["b"], k=True), r"k=True is invalid: must be a number >= 0"),
    (lambda m, t: m.best_of_n("a", ["b", "c"], k=-1), r"k=-1 is invalid"),
    (lambda m, t: m.best_of_n("a", ["b"], kind="greedy"), "allowed values are conservative, optimistic, mean"),
    (lambda m, t: m.best_of_n(["a", "b"], [["c"]]), "2 prompts but 1 candidate lists"),
    (lambda m, t: m.best_of_n(["a", "b"], [["c"], []]), r"at least one candidate \(prompt 1 has none\)"),
    (lambda m, t: m.score(["a"], [[{"role": "assistant", "content": [{"type": "image_url", "image_url": "x"}]}]]),
     r"content parts of type \['image_url'\]; only text parts"),
])
def test_bad_input_is_one_clear_line(model, texts, call, message):
    with pytest.raises(r.UserError, match=message) as error:
        call(model, texts)
    assert "\n" not in str(error.value)


def test_device_mps_is_refused_in_one_line(run_dirs):
    with pytest.raises(r.UserError, match="device='mps' is not supported: use auto, cpu, cuda or cuda:N"):
        r.load_run(run_dirs["bay_lin"], device="mps", progress=False)


def test_numpy_k_and_openai_style_content_parts(model, texts):
    prompts, chosen, _ = texts
    table = model.score(prompts, chosen)
    for k in (np.float32(0.5), np.int64(2), np.float64(1.5)):
        np.testing.assert_allclose(model.reward(prompts, chosen, k=k), table.reward - float(k) * table.uncertainty,
                                   rtol=1e-6)
    # [{"type": "text", "text": ...}] parts are the text they hold (before: the printed list was scored)
    halves = [[{"role": "assistant", "content": [{"type": "text", "text": c[:3]}, {"type": "text", "text": c[3:]}]}]
              for c in chosen]
    # the same rendered texts in the same batches on the same device: the same numbers
    np.testing.assert_allclose(model.score(prompts, halves).reward, table.reward, atol=1e-9)
    user_parts = [[{"role": "user", "content": [{"type": "text", "text": p}]}] for p in prompts]
    np.testing.assert_allclose(model.score(user_parts, chosen).reward, table.reward, atol=1e-9)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory, tiny_backbone):
    """A local encoder-only checkpoint (a 1-layer BERT) with a chat-template tokenizer."""
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=2048, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(folder)
    tiny_backbone.tokenizer.save_pretrained(folder)
    cfg = {"name": "tiny-bert", "hub_id": None, "revision": None, "path": str(folder), "dtype": "float32",
           "trust_remote_code": False}
    from omegaconf import OmegaConf

    return Backbone(OmegaConf.create(cfg), cache_dir=folder, device="cpu")


@pytest.mark.parametrize("method", ["mcd_dpo", "ens_lora"])
def test_causal_methods_refuse_an_encoder_only_backbone(method, tiny_bert):
    from rewarduq_exp.methods.ens_lora import EnsLoRA
    from rewarduq_exp.methods.mcd_dpo import McdDpo

    cls = {"mcd_dpo": McdDpo, "ens_lora": EnsLoRA}[method]
    built = cls(encoder=types.SimpleNamespace(backbone=tiny_bert), device="cpu", show_progress=False)
    train = SyntheticWorld(n_train=8, n_eval=4, n_ood=4).load("train")
    with pytest.raises(r.UserError, match=f"method={method} needs a decoder-only .* 'tiny-bert' is a bert "
                                          "checkpoint") as error:
        built.fit(train)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------------------------------- item 6
def test_batched_best_of_n_equals_one_call_per_prompt(model, texts):
    prompts, chosen, rejected = texts
    candidates = [[chosen[i], rejected[i], chosen[(i + 1) % len(chosen)]][: 1 + i % 3] for i in range(6)]
    for kind, k in (("conservative", 1.0), ("optimistic", 2.0), ("mean", 0.0)):
        batched = model.best_of_n(prompts[:6], candidates, k=k, kind=kind)
        assert len(batched) == 6
        for prompt, group, got in zip(prompts, candidates, batched):
            alone = model.best_of_n(prompt, group, k=k, kind=kind)
            assert got["index"] == alone["index"] and got["completion"] == group[got["index"]]
            assert got[f"{kind}_reward"] == pytest.approx(alone[f"{kind}_reward"], **OTHER_BATCHES_APPROX)
            assert len(got["table"]) == len(group)
    # k is in units of u: k = beta picks by the lower bound
    best = model.best_of_n(prompts[0], [chosen[0], rejected[0], chosen[1]], k=model.beta)
    assert best["conservative_reward"] == pytest.approx(best["lower"], abs=1e-9)
    assert best["index"] == int(np.argmax(best["table"].lower))


def test_a_single_prompt_as_chat_messages_is_one_prompt(model, texts):
    prompts, chosen, rejected = texts
    best = model.best_of_n([{"role": "user", "content": prompts[0]}], [chosen[0], rejected[0]])
    assert isinstance(best, dict)
    assert best["index"] == model.best_of_n(prompts[0], [chosen[0], rejected[0]])["index"]


def test_trl_grpo_trains_on_the_conservative_reward_with_over_long_samples(run_dirs, tmp_path):
    # Two GRPO steps of TRL 1.16 on the tiny policy, rewarded by the API; its random samples all run to 64 tokens,
    # more than max_length=48 with the prompt, so they are truncated instead of aborting the step.
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = r.load_run(run_dirs["bay_lin"], device="cpu", progress=False, max_length=48, truncation=True)
    source = model.method.encoder.backbone.source
    tok = AutoTokenizer.from_pretrained(source)
    prompts = [[{"role": "user", "content": f"Topic {w}: write a reply."}] for w in ("vokefe", "bababa")]
    config = GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                        max_completion_length=64, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                        disable_tqdm=True)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(source), args=config, processing_class=tok,
                          reward_funcs=model.reward_function(k=1.0), train_dataset=Dataset.from_list(
                              [{"prompt": p} for p in prompts * 2]))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "rewards/rewarduq_conservative_reward/mean" in h]
    assert len(logged) == 2 and all(np.isfinite(h["rewards/rewarduq_conservative_reward/mean"]) for h in logged)
    prompt_tokens = len(tok.apply_chat_template(prompts[0], add_generation_prompt=True, tokenize=True,
                                                return_dict=False))
    assert max(h["completions/max_length"] for h in logged) + prompt_tokens > 48  # samples did exceed max_length
    with pytest.raises(r.UserError, match="truncation=True"):
        r.load_run(run_dirs["bay_lin"], max_length=48, progress=False).reward_function()(
            prompts=prompts[:1], completions=[[{"role": "assistant", "content": "tiba " * 80}]])

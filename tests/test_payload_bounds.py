"""A run folder's binary files are read within bounds, and a hostile model folder is refused in one line.

Issue 42 (items 5 and 6): a 2 MB ``probe.npz`` whose deflated member unpacked to 2 GiB was read (15 s, 2.45 GB), a
``.npy`` header declaring 10^12 elements was a 36-line "Unable to allocate 7.28 TiB" traceback, and a model folder
whose config asks to run its own code, a bad adapter config or a pickled ``.bin`` were multi-line tracebacks.

Every hostile file here is built in a few milliseconds (zeros deflate ~1000:1; huge shapes are declared in headers
over a few bytes of data or a sparse file) and plugged into a copy of a small trained run (BoRP and ENS-MLP, trained
once per module). Each is refused in one line naming the file, the array and the bound, by ``load_run``
(``UserError``) and ``evaluate.py`` (exit 2, one ``error:`` line); nothing is allocated for it (numpy's allocations
are traced: the peak stays far below the declared array), nothing runs (a marker file the hostile code would write
never appears), and the refused folder is left byte for byte as it was.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import sys
import time
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from numpy.lib import format as npy
from omegaconf import OmegaConf
from test_cli import NO_FIGURES, run
from test_untrusted_run_folders import snapshot

import rewarduq_exp as r
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.payload_bounds import MAX_ROWS, NpzArrays

PROBE = Path("model") / "probe.npz"
STATE = Path("model") / "state.safetensors"
MIB = 1 << 20


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_cache):
    """(working directory, {method: run folder}): a small BoRP run and a small ENS-MLP run on the synthetic world."""
    cwd = tmp_path_factory.mktemp("payloads")
    folders = {"borp": cwd / "outputs" / "runs" / "borp", "ens_mlp": cwd / "outputs" / "runs" / "ens_mlp"}
    run("train.py", ["method=borp", "probe=borp_contrastive", "dataset=synthetic_ratings", "dataset.n_train=40",
                     "dataset.n_eval=10", "dataset.n_ood=10", "method.baselines=false", "progress=false",
                     *NO_FIGURES, f"hydra.run.dir={folders['borp']}"], cwd, shared_cache)
    run("train.py", ["method=ens_mlp", "dataset.n_train=40", "dataset.n_eval=10", "dataset.n_ood=10",
                     "method.num_heads=3", "method.hidden_dim=16", "progress=false", *NO_FIGURES,
                     f"hydra.run.dir={folders['ens_mlp']}"], cwd, shared_cache)
    return cwd, folders


# ---------------------------------------------------------------------------------------------------- hostile files
def npy_member(zf: zipfile.ZipFile, name: str, shape, dtype: str, data_bytes: int | None = None) -> None:
    """Member ``name.npy``: a header declaring ``shape`` of ``dtype``, then ``data_bytes`` zero bytes (default: what
    the header declares), streamed (never held in memory)."""
    with zf.open(name + ".npy", "w", force_zip64=True) as fh:
        npy.write_array_header_1_0(fh, {"descr": dtype, "fortran_order": False, "shape": tuple(shape)})
        left = math_prod(shape) * np.dtype(dtype).itemsize if data_bytes is None else data_bytes
        block = bytes(4 * MIB)
        while left > 0:
            fh.write(block[:min(left, len(block))])
            left -= len(block)


def math_prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def replace_member(path: Path, name: str, shape, dtype: str, data_bytes: int | None = None, extra=()) -> None:
    """Rewrite the .npz at ``path`` (deflated) with member ``name`` replaced (or added) and ``extra`` raw members."""
    old = path.read_bytes()
    import io

    with zipfile.ZipFile(io.BytesIO(old)) as zin, \
            zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zout:
        for info in zin.infolist():
            if info.filename != name + ".npy":
                zout.writestr(info.filename, zin.read(info))
        if name:
            npy_member(zout, name, shape, dtype, data_bytes)
        for member, data in extra:
            zout.writestr(member, data)


def deflated_300_mib(folder: Path) -> None:
    """The tester's case, 300 MiB instead of 2 GiB: train_rows unpacks to 300 MiB of zeros (a 0.3 MB member)."""
    replace_member(folder / PROBE, "train_rows", (300 * MIB // 8,), "<i8")


def declared_10_12(folder: Path) -> None:
    """A header that declares 10^12 float64 (7.3 TiB) over 2 KiB of data."""
    replace_member(folder / PROBE, "polarization/centroid", (10**12,), "<f8", data_bytes=2048)


def extra_member(folder: Path) -> None:
    replace_member(folder / PROBE, "evil", (1000,), "<f8")


def object_member(folder: Path) -> None:
    """A member of dtype object: numpy would need a pickle for it."""
    replace_member(folder / PROBE, "", (), "", extra=[("evil.npy", npy_bytes_object())])


def npy_bytes_object() -> bytes:
    import io

    buf = io.BytesIO()
    npy.write_array_header_1_0(buf, {"descr": "|O", "fortran_order": False, "shape": (1,)})
    return buf.getvalue() + b"\x80\x04N."   # a pickle of None


def many_members(folder: Path) -> None:
    replace_member(folder / PROBE, "", (), "", extra=[(f"m{i}.npy", b"") for i in range(300)])


NPZ_CASES = {
    "deflated_300_mib": (deflated_300_mib, r"array 'train_rows' declares shape \(39321600,\) of int64 \(300\.0 MiB\); "
                                           r"this run's settings allow shape \(<=\d+,\) of int \(feature_dim=256, "
                                           r"train_responses=40 in method.json\); refused before reading it"),
    "declared_10_12": (declared_10_12, r"array 'polarization/centroid' declares shape \(1000000000000,\) of float64 "
                                       r"\(7\.3 TiB\), but its member holds 2\.0 KiB of data; refused before reading"),
    "extra_member": (extra_member, r"holds an array 'evil' \(shape \(1000,\) of float64 \(7\.8 KiB\)\) that a saved "
                                   r"model of these settings never has; refused before reading it"),
    "object_member": (object_member, r"array 'evil' has dtype 'object', not plain numbers or text \(Python objects "
                                     r"would need a pickle, which is never loaded\)"),
    "many_members": (many_members, r"its zip directory declares 30\d members in [\d.]+ KiB, more than the 256 a "
                                   r"saved BoRP probe may have; refused before reading it"),
}


def header_file(path: Path, header: dict, data_bytes: int, sparse: bool = False, length: int | None = None) -> None:
    """A safetensors file: the 8-byte length (``length``, default the header's), the JSON header, then
    ``data_bytes`` zeros (a hole of that size when ``sparse``: nothing is written to disk)."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw) if length is None else length) + raw)
        if sparse:
            fh.truncate(8 + len(raw) + data_bytes)
        else:
            fh.write(bytes(data_bytes))


def saved_header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])


ITEMSIZE = {"F32": 4, "F64": 8, "I64": 8, "I32": 4, "F16": 2, "BF16": 2}


def enlarge(path: Path, name: str, shape) -> None:
    """Rewrite the safetensors file at ``path`` consistently (offsets re-tiled) with tensor ``name`` declared of
    ``shape``: a sparse file, so no disk is used for the zeros it holds."""
    header = saved_header(path)
    entries = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    header[name]["shape"] = list(shape)
    offset = 0
    for key in entries:
        size = ITEMSIZE[header[key]["dtype"]] * math_prod(header[key]["shape"])
        header[key]["data_offsets"] = [offset, offset + size]
        offset += size
    header_file(path, header, offset, sparse=True)


def st_declared_10_12(folder: Path) -> None:
    """heads.weights.0 declares 10^6 x 10^6 float32 (3.6 TiB) over the bytes it had."""
    header = saved_header(folder / STATE)
    header["heads.weights.0"]["shape"] = [10**6, 10**6]
    header_file(folder / STATE, header, max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"))


def st_overlapping_offsets(folder: Path) -> None:
    header = saved_header(folder / STATE)
    entries = {k: e for k, e in header.items() if k != "__metadata__"}
    end = max(e["data_offsets"][1] for e in entries.values())
    first, second = sorted(entries, key=lambda k: entries[k]["data_offsets"][0])[:2]
    size = entries[second]["data_offsets"][1] - entries[second]["data_offsets"][0]
    start = entries[first]["data_offsets"][0]
    entries[second]["data_offsets"] = [start, start + size]  # on top of the first tensor
    header_file(folder / STATE, header, end)


def st_oversized_header(folder: Path) -> None:
    """A header length of 200 MiB (in a small file: the length alone is refused)."""
    header_file(folder / STATE, {}, 0, length=200 * MIB)


def st_beyond_settings(folder: Path) -> None:
    """A consistent file whose first weight stack is 100 x wider than the run's features: the settings rule it
    out."""
    enlarge(folder / STATE, "heads.weights.0", (3, 25_600, 16))


ST_CASES = {
    "declared_10_12": (st_declared_10_12, r"is corrupt: tensor 'heads.weights.0' declares shape \(1000000, 1000000\) "
                                          r"of F32 \(3\.6 TiB\) but its data_offsets span \d+ bytes"),
    "overlapping_offsets": (st_overlapping_offsets, r"is corrupt \(tensor '[^']+' overlaps another tensor or leaves "
                                                    r"a gap before it\)"),
    "oversized_header": (st_oversized_header, r"is refused: its header declares 209715200 bytes, more than the "
                                              r"16777216 a safetensors file of a run may have \(not read\)"),
    "beyond_settings": (st_beyond_settings, r"tensor 'heads.weights.0' declares shape \(3, 25600, 16\) of F32 "
                                            r"\(4\.7 MiB\); this run's settings allow shape \(3, 256, 16\) of float "
                                            r"\(num_heads=3, hidden_dim=16, num_hidden_layers=2, feature_dim=256 in "
                                            r"method.json\); refused before reading it"),
}


# ---------------------------------------------------------------------------------------------------- the checks
def refused_in_one_line(copy: Path, named: Path, pattern: str, cwd, cache) -> None:
    """load_run raises one UserError line naming the file and matching ``pattern``, fast and with no large numpy
    allocation; evaluate.py exits 2 with one error line; the folder is unchanged."""
    before = snapshot(copy)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(UserError) as error:
            r.load_run(copy, progress=False, device="cpu", cache_dir=cache)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    seconds = time.perf_counter() - start
    message = str(error.value)
    assert "\n" not in message and str(copy / named) in message, message
    assert re.search(pattern, message), message
    assert peak < 64 * MIB, f"{peak / MIB:.0f} MiB allocated while refusing it"
    assert seconds < 20, seconds

    proc = run("evaluate.py", [f"run={copy}", "device=cpu"], cwd, cache, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(copy / named) in lines[0], proc.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert snapshot(copy) == before


@pytest.mark.parametrize("case", list(NPZ_CASES))
def test_a_hostile_probe_npz_is_refused_before_it_is_read(case, runs, shared_cache, tmp_path):
    cwd, folders = runs
    damage, pattern = NPZ_CASES[case]
    copy = tmp_path / "run"
    shutil.copytree(folders["borp"], copy)
    damage(copy)
    refused_in_one_line(copy, PROBE, pattern, cwd, shared_cache)


@pytest.mark.parametrize("case", list(ST_CASES))
def test_a_hostile_state_safetensors_is_refused_before_it_is_read(case, runs, shared_cache, tmp_path):
    cwd, folders = runs
    damage, pattern = ST_CASES[case]
    copy = tmp_path / "run"
    shutil.copytree(folders["ens_mlp"], copy)
    damage(copy)
    refused_in_one_line(copy, STATE, pattern, cwd, shared_cache)


def test_the_bounds_come_from_the_runs_settings(runs, shared_cache, tmp_path):
    """The untouched runs load; a probe read without the run's settings is bounded by the module's caps; a fit
    summary that claims a huge feature dimension is refused as a field of method.json."""
    from rewarduq_exp.methods.borp import BorpProbe

    _, folders = runs
    for folder in folders.values():
        assert len(r.load_run(folder, progress=False, device="cpu", cache_dir=shared_cache)
                   .score(["Name a colour."], ["Blue."])) == 1
    probe = BorpProbe.load(folders["borp"] / PROBE)   # no settings: the caps
    assert probe.train_rows_.shape == (probe.train_rows_.shape[0],)
    copy = tmp_path / "probe.npz"
    shutil.copy(folders["borp"] / PROBE, copy)
    replace_member(copy, "train_rows", (MAX_ROWS + 1,), "<i8", data_bytes=8 * (MAX_ROWS + 1))
    with pytest.raises(UserError, match=rf"array 'train_rows' declares shape \({MAX_ROWS + 1},\) of int64 .* allow "
                                        rf"shape \(<={MAX_ROWS},\) of int \(no fit summary"):
        BorpProbe.load(copy)
    run_copy = tmp_path / "run"
    shutil.copytree(folders["ens_mlp"], run_copy)
    info = json.loads((run_copy / "model" / "method.json").read_text())
    info["fit_summary"]["feature_dim"] = 10**9
    (run_copy / "model" / "method.json").write_text(json.dumps(info))
    with pytest.raises(UserError, match=r"method.json: field \"fit_summary.feature_dim\" is 1000000000, not a whole "
                                        r"number in 1\.\.131072"):
        r.load_run(run_copy, progress=False, device="cpu", cache_dir=shared_cache)


def test_npz_headers_are_read_without_the_data(tmp_path):
    """NpzArrays reads the zip directory and the .npy headers only: a member declaring 256 MiB costs nothing until
    it is read, and it cannot be read before its shape was checked."""
    path = tmp_path / "a.npz"
    np.savez(path, small=np.arange(3.0))
    replace_member(path, "big", (1 << 25,), "<i8")     # 256 MiB of zeros, a 0.3 MB member
    tracemalloc.start()
    try:
        with NpzArrays(path, "test file") as npz:
            assert npz.declared["big"].shape == (1 << 25,) and npz.declared["big"].nbytes == 256 * MIB
            with pytest.raises(RuntimeError, match="read before its declared shape was checked"):
                npz.read("big")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MIB


def test_a_zip64_directory_cannot_hide_its_size(tmp_path):
    """The directory's size is read as zipfile reads it: from the zip64 record where one precedes the end record (a
    small count in the 32-bit record does not hide a million entries)."""
    path = tmp_path / "a.npz"
    np.savez(path, x=np.arange(3.0))
    raw = path.read_bytes()
    at = raw.rfind(b"PK\x05\x06")
    record = struct.pack("<4sQHHLLQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, 10**6, 10**6, 46 * 10**6, 0)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, at, 1)
    path.write_bytes(raw[:at] + record + locator + raw[at:])
    with pytest.raises(UserError, match=r"a.npz: its zip directory declares 1000000 members in 43\.9 MiB, more than "
                                        r"the 256 a saved test file may have; refused before reading it"):
        NpzArrays(path, "test file")


# ---------------------------------------------------------------------------------------------------- label ranking
def test_label_ranking_files_are_bounded_by_their_fitted_sizes(tmp_path):
    from rewarduq_exp.methods.base import load_method
    from rewarduq_exp.methods.label_ranking import MallowsLearner, PlackettLuceNet, RPCLearner

    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 3))
    ranks = np.argsort(np.argsort(rng.normal(size=(40, 4)), axis=1), axis=1) + 1
    for cls, kw in ((PlackettLuceNet, {"num_epochs": 1, "hidden": (8,)}), (MallowsLearner, {}), (RPCLearner, {})):
        folder = tmp_path / cls.name
        cls(seed=0, **kw).fit(X, ranks).save(folder)
        load_method(folder)   # loads as saved
        name = next(k for k in saved_header(folder / "state.safetensors") if k != "__metadata__")
        shape = saved_header(folder / "state.safetensors")[name]["shape"]
        enlarge(folder / "state.safetensors", name, [10**6, *shape[1:]])
        with pytest.raises(UserError, match=rf"state.safetensors: .*tensor '{re.escape(name)}' declares shape "
                                            rf"\(1000000,.*this run's settings allow shape"):
            load_method(folder)
    # RPC's trees (skops): a zip member that unpacks beyond what m pairs of trees on n rows can take
    folder = tmp_path / "rpc_bomb"
    RPCLearner(seed=0).fit(X, ranks).save(folder)
    with zipfile.ZipFile(folder / "pairs.skops", "a", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        npy_member(zf, "bomb", (8 * MIB // 8,), "<f8")
    with pytest.raises(UserError, match=r"pairs.skops: its members unpack to \d+\.\d MiB, more than the .* this run's "
                                        r"settings allow \(m=4, train_rows=40 in method.json, cv=2\)"):
        load_method(folder)


# ---------------------------------------------------------------------------------------------------- model folders
@pytest.fixture
def marker(tmp_path):
    return tmp_path / "pwned.txt"


def model_folder(tiny_backbone, where: Path) -> Path:
    shutil.copytree(tiny_backbone.source, where)
    return where


def remote_code_folder(tiny_backbone, where: Path, marker: Path) -> Path:
    """The tiny model, with a config.json whose model type transformers does not know and an auto_map to a module
    of the folder that writes ``marker`` when imported."""
    folder = model_folder(tiny_backbone, where)
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": "evilmodel", "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                    "from transformers import Qwen3Config as EvilConfig, Qwen3Model as EvilModel\n")
    return folder


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (__import__("os").system, (f"touch {self.marker}",))


def pickle_folder(tiny_backbone, where: Path, marker: Path) -> Path:
    """The tiny model with its weights as a pickle (pytorch_model.bin) that runs a command when unpickled."""
    folder = model_folder(tiny_backbone, where)
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": _Evil(marker)}, folder / "pytorch_model.bin")
    return folder


def backbone_at(folder: Path, cache):
    from rewarduq_exp.models.backbone import Backbone

    cfg = OmegaConf.load(Path(__file__).parents[1] / "conf" / "model" / "tiny-qwen3.yaml")
    cfg.builder, cfg.path = None, str(folder)
    return Backbone(cfg, cache_dir=cache, device="cpu")


def test_a_model_folder_that_asks_to_run_its_own_code_is_refused(tiny_backbone, runs, shared_cache, tmp_path, marker):
    folder = remote_code_folder(tiny_backbone, tmp_path / "remote", marker)
    backbone = backbone_at(folder, shared_cache)
    with pytest.raises(UserError) as error:
        backbone.load_encoder()
    assert str(error.value) == (
        f"{folder / 'config.json'} asks to run its own code (auto_map: evil.EvilConfig, evil.EvilModel) to load the "
        "weights of model 'tiny-qwen3'; nothing of it was run. Allow it only if you trust that checkpoint: "
        "model.trust_remote_code=true (for a run folder: a config that says so, loaded with trust_remote_code=true)")
    # through train.py: exit status 2, one line
    cwd, _ = runs
    proc = run("train.py", ["model.builder=null", f"model.path={folder}", "dataset.n_train=20", "dataset.n_eval=10",
                            "dataset.n_ood=10", "progress=false", *NO_FIGURES, f"hydra.run.dir={tmp_path / 'run'}"],
               cwd, shared_cache, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: {folder / 'config.json'} asks to run its own code"), lines[0]
    assert not marker.exists()


def test_a_pickled_checkpoint_that_would_run_code_is_refused(tiny_backbone, runs, shared_cache, tmp_path, marker):
    folder = pickle_folder(tiny_backbone, tmp_path / "pickled", marker)
    with pytest.raises(UserError) as error:
        backbone_at(folder, shared_cache).load_encoder()
    assert str(error.value) == (
        f"{folder / 'pytorch_model.bin'} would run code when loaded (GLOBAL posix.system): torch.load's weights-only "
        "mode refused it and nothing of it was run, so the weights of model 'tiny-qwen3' cannot be loaded; use a "
        "checkpoint saved as safetensors (model.safetensors), or convert this one on a machine where you trust it")
    # a run folder scored on it (load_run's backbone_path): the same line
    _, folders = runs
    model = r.load_run(folders["ens_mlp"], progress=False, device="cpu", cache_dir=shared_cache,
                       backbone_path=folder)
    with pytest.raises(UserError, match=rf"^{re.escape(str(folder / 'pytorch_model.bin'))} would run code"):
        model.score(["An unseen prompt?"], ["An unseen answer."])
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------------- ENS-LoRA
@pytest.fixture(scope="module")
def lora_folder(tmp_path_factory, tiny_backbone):
    """An (untrained) ENS-LoRA of 2 members, rank 2, saved: PEFT's adapter layout."""
    from rewarduq_exp.methods.ens_lora import EnsLoRA

    method = EnsLoRA(encoder=_Encoder(tiny_backbone), num_members=2, lora_rank=2, lora_alpha=4, device="cpu",
                     show_progress=False)
    method._build()
    folder = tmp_path_factory.mktemp("lora") / "model"
    method.save(folder)
    return folder


class _Encoder:
    def __init__(self, backbone):
        self.backbone = backbone


@pytest.fixture
def megatron_module(tmp_path, monkeypatch, marker):
    """A module on sys.path whose name PEFT would import for a megatron_config (its prefix check passes)."""
    (tmp_path / "megatron_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "megatron_evil"
    sys.modules.pop("megatron_evil", None)


def adapter_change(change):
    def damage(folder: Path):
        path = folder / "adapters" / "m1" / "adapter_config.json"
        path.write_text(json.dumps(change(json.loads(path.read_text()))))
    return damage


def adapter_weights_beyond_rank(folder: Path):
    path = folder / "adapters" / "m0" / "adapter_model.safetensors"
    name = next(k for k in saved_header(path) if k.endswith("q_proj.lora_A.weight"))
    enlarge(path, name, (100_000, saved_header(path)[name]["shape"][1]))


LORA_CASES = {
    "rank": (adapter_change(lambda c: c | {"r": 1_000_000}), "adapters/m1/adapter_config.json",
             r"field \"r\" is 1000000; method.json says lora_rank=2; refused before PEFT reads it"),
    "peft_type": (adapter_change(lambda c: c | {"peft_type": "EVIL"}), "adapters/m1/adapter_config.json",
                  r"field \"peft_type\" is 'EVIL'; an ENS-LoRA adapter is LORA"),
    "megatron": (adapter_change(lambda c: c | {"megatron_config": {"x": 1}, "megatron_core": "megatron_evil"}),
                 "adapters/m1/adapter_config.json",
                 r"field \"megatron_config\" is \{'x': 1\}; a saved ENS-LoRA adapter never sets it"),
    "targets": (adapter_change(lambda c: c | {"target_modules": ["nothing_here"]}), "adapters/m1/adapter_config.json",
                r"field \"target_modules\" names no layer of model 'tiny-qwen3'"),
    "weights": (adapter_weights_beyond_rank, "adapters/m0/adapter_model.safetensors",
                r"tensor 'base_model.model.layers.0.self_attn.q_proj.lora_A.weight' declares shape \(100000, 256\) "
                r"of F32 .*allow shape \(2, 256\) of float \(lora_rank=2 and the Linear layers.0.self_attn.q_proj"),
}


@pytest.mark.parametrize("case", list(LORA_CASES))
def test_a_hostile_adapter_is_refused_before_peft_reads_it(case, lora_folder, tiny_backbone, tmp_path, marker,
                                                           megatron_module):
    from rewarduq_exp.methods.base import load_method

    damage, named, pattern = LORA_CASES[case]
    copy = tmp_path / "model"
    shutil.copytree(lora_folder, copy)
    damage(copy)
    before = snapshot(copy)
    with pytest.raises(UserError) as error:
        load_method(copy, encoder=_Encoder(tiny_backbone), device="cpu", show_progress=False)
    message = str(error.value)
    assert "\n" not in message and message.startswith(str(copy / named)), message
    assert re.search(pattern, message), message
    assert not marker.exists()
    assert snapshot(copy) == before


def test_a_policy_file_is_bounded_by_the_models_own_parameters(tiny_backbone, tmp_path):
    """MCD-DPO's policy.safetensors: every tensor it declares must be a parameter of the backbone, of its shape."""
    from rewarduq_exp.methods.base import load_method
    from rewarduq_exp.methods.mcd_dpo.method import WEIGHTS_FILE, McdDpo

    method = McdDpo(encoder=_Encoder(tiny_backbone), device="cpu", show_progress=False)
    method._ensure_policy()
    folder = tmp_path / "model"
    method.save(folder)
    enlarge(folder / WEIGHTS_FILE, "lm_head.weight", (11_060, 256))   # 10 x the vocabulary (tied: saved once)
    before = snapshot(folder)
    with pytest.raises(UserError) as error:
        load_method(folder, encoder=_Encoder(tiny_backbone), device="cpu", show_progress=False)
    assert str(error.value) == (
        f"{folder / WEIGHTS_FILE}: tensor 'lm_head.weight' declares shape (11060, 256) of F32 (10.8 MiB); "
        "this run's settings allow shape (1106, 256) of float (the parameters of model 'tiny-qwen3'); refused before "
        "reading it; the run folder is damaged: copy it again or retrain")
    assert snapshot(folder) == before


# ---------------------------------------------------------------------------------------- poisoned values (NaN, inf)
def poison(path: Path, endswith: str, value: float) -> str:
    """Set one value of the first floating tensor of the safetensors file at ``path`` whose name ends with
    ``endswith`` to ``value`` (the file otherwise as it was); returns the tensor's name."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as fh:
        metadata = fh.metadata()
    tensors = load_file(str(path))
    name = next(k for k, v in tensors.items() if k.endswith(endswith) and v.is_floating_point())
    tensors[name].view(-1)[0] = value
    save_file(tensors, str(path), metadata=metadata)
    return name


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_poisoned_state_is_refused_by_the_api_and_evaluate(value, runs, shared_cache, tmp_path):
    """Fourth hardening round, item 5: load_run scored NaN from poisoned weights with exit 0. Every method whose
    state is a safetensors file read by load_safetensors (every feature head, the LoRA heads and LA-LoRA's
    posterior) meets the same check."""
    cwd, folders = runs
    copy = tmp_path / "run"
    shutil.copytree(folders["ens_mlp"], copy)
    name = poison(copy / STATE, "weights.0", value)
    refused_in_one_line(copy, STATE, rf"tensor '{re.escape(name)}' holds NaN or inf values; the run folder is "
                                     r"damaged", cwd, shared_cache)


def test_a_poisoned_adapter_or_policy_is_refused_at_load(lora_folder, tiny_backbone, tmp_path):
    """The weights PEFT or safetensors load straight into a model (ENS-LoRA's adapters, MCD-DPO's policy) are
    checked after loading, by the same check."""
    from rewarduq_exp.methods.base import load_method
    from rewarduq_exp.methods.mcd_dpo.method import WEIGHTS_FILE, McdDpo

    copy = tmp_path / "lora"
    shutil.copytree(lora_folder, copy)
    adapter = copy / "adapters" / "m1" / "adapter_model.safetensors"
    poison(adapter, "lora_B.weight", float("nan"))
    with pytest.raises(UserError, match=r"holds NaN or inf values") as error:
        load_method(copy, encoder=_Encoder(tiny_backbone), device="cpu", show_progress=False)
    assert str(error.value).startswith(f"{adapter}: tensor '") and "lora_B" in str(error.value)

    method = McdDpo(encoder=_Encoder(tiny_backbone), device="cpu", show_progress=False)
    method._ensure_policy()
    folder = tmp_path / "mcd"
    method.save(folder)
    poison(folder / WEIGHTS_FILE, "weight", float("-inf"))
    with pytest.raises(UserError, match=r"holds NaN or inf values") as error:
        load_method(folder, encoder=_Encoder(tiny_backbone), device="cpu", show_progress=False)
    assert str(error.value).startswith(f"{folder / WEIGHTS_FILE}: tensor '")

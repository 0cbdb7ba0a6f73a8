"""What ``scripts/bench_gpu.py`` measures with: timing around device synchronisations, peak memory (CUDA's allocator or
the process's resident set), the GPU's dense bf16 peak for MFU, the planner's peaks of the measured configurations,
and random-init models served where the methods expect a backbone."""

from __future__ import annotations

import contextlib
import gc
import re
import shutil
import time
from pathlib import Path

import torch

# Dense bf16 peak TFLOPS by a substring of torch.cuda.get_device_name (first match wins: PCIe before SXM).
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


# ---------------------------------------------------------------------------------------------------- measuring
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, repeats: int, device: torch.device) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return times


class Memory:
    """Peak memory of one measurement: CUDA's allocator peak, or the process's peak resident set on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "process peak RSS (VmHWM)"

    def reset(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        with contextlib.suppress(OSError):   # "5" resets the peak resident set (Linux); elsewhere it is process-wide
            Path("/proc/self/clear_refs").write_text("5")

    def peak(self) -> float | None:
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device))
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:
            return None
        found = re.search(r"VmHWM:\s+(\d+)\s+kB", status)
        return float(found.group(1)) * 1024 if found else None


def oom(err: BaseException) -> str:
    return f"out of memory: {(str(err).splitlines() or [''])[0]}"


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_tflops(device: torch.device, override: float | None) -> tuple[str, float | None]:
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    if override:
        return name, float(override)
    return name, next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


# ---------------------------------------------------------------------------------------------------- the planner
class Planner:
    """Planned peaks of one shape: ``make_plan`` on the composed train config of each measured configuration."""

    def __init__(self, model: str, device: str, length: int, pairs: int, cache_dir: str):
        self.base = [f"model={model}", f"max_length={length}", f"plan.device={device}", f"plan.n_train={pairs}",
                     "plan.n_eval=1", f"paths.cache_dir={cache_dir}"]
        self.plans: dict[str, dict] = {}

    def phase(self, key: str, overrides: list[str], phase: str) -> tuple[float | None, str | None]:
        """(planned peak of ``phase`` in bytes, None) or (None, why the planner cannot say)."""
        from rewarduq_exp.core.errors import UserError
        from rewarduq_exp.runner.plan import compose_points, make_plan

        try:
            (_, cfg), = compose_points([*self.base, *overrides])
            plan = make_plan(cfg)
        except UserError as err:
            return None, str(err)
        self.plans[key] = {"overrides": [*self.base, *overrides], **plan.as_dict()}
        found = [p for p in plan.phases if p.name == phase]
        if not found:
            return None, f"the {plan.method} plan has no {phase} phase"
        return found[0].peak, None


# ---------------------------------------------------------------------------------------------------- models
class RandomBackbone:
    """What ``EnsLoRA`` reads of its encoder's backbone, serving an already built random-init body."""

    def __init__(self, name: str, dtype: torch.dtype, body):
        self.name, self.dtype, self.body = name, dtype, body
        self.tokenizer = type("Tokenizer", (), {"pad_token_id": 0})()   # ENS-LoRA's training step pads its rows

    def require_decoder(self, method: str) -> None:   # a Qwen3 body is a decoder
        pass

    def from_pretrained(self, auto_class, what: str = "weights", **kwargs):
        return self.body


class Encoder:
    def __init__(self, backbone):
        self.backbone = backbone


def random_model(auto_class, config, dtype: torch.dtype, device: torch.device):
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = auto_class.from_config(config, dtype=dtype)
    return model


def random_checkpoint(shape: str, cache_dir, device: torch.device) -> Path:
    """A random-init checkpoint of a shipped shape (``conf/model/shapes/<shape>.json``) in bf16, with the tiny model's
    tokenizer (its ids are a subset of the vocabulary), built once on ``device`` into
    ``<cache_dir>/models/random-<shape>`` under a lock and reused after: ``bench_gpu.py``'s extraction body and
    ``gpu_check.py``'s mission (``model.path``) load the same weights, so a node builds and writes the 8 GB of a 4B
    backbone once, not once per step and per check."""
    import json

    from filelock import FileLock
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from rewarduq_exp.models.shapes import SHAPES_DIR
    from rewarduq_exp.models.tiny_qwen3 import ensure_tiny_qwen3, save_checkpoint

    into = Path(cache_dir) / "models" / f"random-{shape}"
    into.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(into) + ".lock"):
        if (into / "model.safetensors").exists():
            return into
        fields = json.loads((SHAPES_DIR / f"{shape}.json").read_text())
        fields.pop("architectures", None)
        tok = AutoTokenizer.from_pretrained(ensure_tiny_qwen3(cache_dir))
        config = AutoConfig.for_model(fields.pop("model_type"), **fields, pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id, bos_token_id=None)
        model = random_model(AutoModel, config, torch.bfloat16, device)
        tmp = into.with_name(into.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)   # what a killed build left
        tmp.mkdir()
        save_checkpoint(model, tmp)
        tok.save_pretrained(tmp)
        del model
        free(device)
        tmp.rename(into)
    return into


def checkpointing_on(model, on: bool) -> None:
    """Activation checkpointing on or off (transformers 5.24 renamed gradient_checkpointing_*; the old names warn)."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def autocast(device: torch.device, dtype: torch.dtype):
    if dtype != torch.float32:
        return torch.autocast(device.type, dtype=dtype)
    return torch.autocast(device.type, enabled=False)

"""K LoRA members on one frozen base as ONE batched forward: the base projection once over every member's rows, the
K low-rank updates as one batched matmul over stacked adapter weights.

An ensemble of LoRA adapters (ENS-LoRA, RewardUQ section 4.2) runs the same frozen body K times with a different
rank-r update on every targeted ``nn.Linear``: ``y = x W^T + (alpha / r) * B_k A_k dropout(x)``. Here each targeted
Linear is wrapped by :class:`MultiLoRALinear`, which holds the K members' weights stacked (``lora_A`` of shape
``(K, r, in)``, ``lora_B`` of shape ``(K, out, r)``, float32 like PEFT's adapters on a bf16 base) and runs

* all members at once: the rows of a batch are laid out member-major, K contiguous blocks of equal size with block k
  under member k (the batch replicated K times). The base GEMM runs once over all K x B rows, then one ``bmm`` gives
  the K rank-r projections and one ``baddbmm_`` adds the K updates into the base output in place: the FLOPs of K
  passes in a few large GEMMs, with no Python loop over members and no gather or scatter of rows (PEFT's
  ``adapter_names=`` batch selects and scatters the rows of every adapter in every layer);
* one member (``members=k``): the rows are all under member k, computed as PEFT computes its active adapter.

Routing is an explicit argument of every call: :meth:`MultiLoRAModel.forward` takes ``members`` (an index, or a
sequence of indices, one per block) or PEFT's ``adapter_names`` (one name per row; equal contiguous blocks), holds it
for the duration of the call, and the wrapped Linears read it. Nothing outside a call is routed: a Linear that runs
without routing raises. Activation checkpointing (non-reentrant) recomputes a layer during backward, after the call
has returned; :meth:`MultiLoRAModel.checkpointing` therefore installs a ``context_fn`` that captures the routing at
each checkpointed call and restores exactly it around that call's recomputation, so the recomputed layer sees the
routing of its own forward whatever runs in between (torch also restores the RNG state there, so dropout masks are
the same).

Weights are built and stored as PEFT builds and stores them: :func:`from_peft` moves the adapters of a PEFT model
(``get_peft_model`` + ``add_adapter``, or ``PeftModel.from_pretrained`` + ``load_adapter``) into the stacked
module, and :meth:`MultiLoRAModel.save_adapters` writes PEFT's on-disk layout (``<dir>/<member>/adapter_config.json``
+ ``adapter_model.safetensors``) that PEFT loads back. :meth:`MultiLoRAModel.to_peft` gives the same weights back as
a PEFT model (a reference, and the mixed-adapter comparison of the benchmarks).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rewarduq_exp.core.errors import UserError

PEFT_PREFIX = "base_model.model."   # PEFT's key prefix for a PeftModel around a headless body (no task type)


class _Routing:
    """The members of the running forward's row blocks (``None`` outside a forward). Shared by the model and all of
    its wrapped Linears; set only by :meth:`use`, around a call or a checkpointed layer's recomputation."""

    def __init__(self):
        self.members: tuple[int, ...] | None = None

    @contextlib.contextmanager
    def use(self, members: tuple[int, ...] | None):
        previous, self.members = self.members, members
        try:
            yield
        finally:
            self.members = previous


class MultiLoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus K stacked LoRA members (module docstring). ``lora_A``: ``(K, r, in)``,
    ``lora_B``: ``(K, out, r)``, ``scaling`` = alpha / r, ``dropout``: lora_dropout on the input of A (train mode)."""

    def __init__(self, base_layer: nn.Linear, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float,
                 dropout: float, routing: _Routing):
        super().__init__()
        k, r, fan_in = lora_A.shape
        if tuple(lora_B.shape) != (k, base_layer.out_features, r) or fan_in != base_layer.in_features:
            raise ValueError(f"LoRA shapes {tuple(lora_A.shape)} / {tuple(lora_B.shape)} do not fit a Linear "
                             f"{base_layer.in_features} -> {base_layer.out_features}")
        self.base_layer = base_layer
        self.lora_A = nn.Parameter(lora_A)
        self.lora_B = nn.Parameter(lora_B)
        self.scaling = float(scaling)
        self.dropout = float(dropout)
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self._routing = routing   # a plain attribute: not a submodule, not in the state dict
        self._all = tuple(range(k))

    @property
    def num_members(self) -> int:
        return self.lora_A.shape[0]

    def extra_repr(self) -> str:
        k, r, _ = self.lora_A.shape
        return f"members={k}, r={r}, scaling={self.scaling:g}, dropout={self.dropout:g}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        members = self._routing.members
        if members is None:
            raise RuntimeError("a MultiLoRALinear ran outside a MultiLoRAModel call: no member routing (with "
                               "activation checkpointing, enable it with MultiLoRAModel.checkpointing)")
        result = self.base_layer(x)
        # PEFT casts the input to the adapters' dtype (float32): under autocast the matmuls below run in the autocast
        # dtype either way (a bf16 -> float32 -> bf16 round trip is exact), so the cast is skipped there.
        lora_x = x if torch.is_autocast_enabled(x.device.type) else x.to(self.lora_A.dtype)
        if self.dropout and self.training:
            lora_x = F.dropout(lora_x, self.dropout, training=True)   # one mask per element: per row, per member
        if len(members) == 1:   # one member: PEFT's own sequence of operations for its active adapter
            k = members[0]
            update = F.linear(F.linear(lora_x, self.lora_A[k]), self.lora_B[k]) * self.scaling
            return (result + update).to(result.dtype)
        n = len(members)
        if x.shape[0] % n:
            raise ValueError(f"{x.shape[0]} rows are not {n} equal member blocks")
        if members == self._all:
            a, b = self.lora_A, self.lora_B
        else:
            index = torch.as_tensor(members, device=self.lora_A.device)
            a, b = self.lora_A.index_select(0, index), self.lora_B.index_select(0, index)
        # Block m of the rows (member-major) is the m-th matrix of the batch: (n, rows/n * positions, features).
        h = torch.bmm(lora_x.reshape(n, -1, self.in_features), a.transpose(1, 2))
        out = result.view(n, -1, self.out_features)
        if h.dtype == result.dtype or torch.is_autocast_enabled(x.device.type):
            # Added in place into the base output (a fresh tensor that the base layer's backward does not need): no
            # copy of the (rows, out) output. In-place ops skip autocast: B is cast as autocast would cast it.
            out.baddbmm_(h.to(result.dtype), b.transpose(1, 2).to(result.dtype), alpha=self.scaling)
            return result
        # No autocast, float32 adapters on a lower-precision base: added in float32, then rounded (as PEFT does).
        out = torch.baddbmm(out.to(h.dtype), h, b.transpose(1, 2), alpha=self.scaling)
        return out.to(result.dtype).view(result.shape)


def _parent(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, name = path.rpartition(".")
    return (root.get_submodule(parent) if parent else root), name


class MultiLoRAModel(nn.Module):
    """A headless decoder whose targeted Linears run K LoRA members (module docstring). Called like the decoder
    (``input_ids``, ``attention_mask``, ``position_ids``, a cache, ...) plus the routing: ``members`` or
    ``adapter_names``. ``peft_configs`` (member name -> PEFT ``LoraConfig``) is what :meth:`save_adapters` writes."""

    def __init__(self, base: nn.Module, member_names: Sequence[str], layers: dict[str, dict], peft_configs: dict):
        super().__init__()
        self.base_model = base
        self.member_names = list(member_names)
        self.peft_configs = dict(peft_configs)
        self.routing = _Routing()
        self._index = {name: k for k, name in enumerate(self.member_names)}
        if len(self._index) != len(self.member_names):
            raise ValueError(f"member names repeat: {self.member_names}")
        self.targets: list[str] = []
        for path, spec in layers.items():
            parent, name = _parent(base, path)
            linear = getattr(parent, name)
            if type(linear) is not nn.Linear:
                raise UserError(f"LoRA target {path} is a {type(linear).__name__}, not a Linear: only Linear layers "
                                "run as a multi-LoRA ensemble")
            setattr(parent, name, MultiLoRALinear(linear, spec["A"], spec["B"], spec["scaling"], spec["dropout"],
                                                  self.routing))
            self.targets.append(path)

    # -------------------------------------------------------------------------------------------- what callers read
    @property
    def config(self):
        return self.base_model.config

    @property
    def num_members(self) -> int:
        return len(self.member_names)

    def get_base_model(self) -> nn.Module:
        return self.base_model

    @property
    def is_activation_checkpointing(self) -> bool:
        try:
            return bool(self.base_model.is_activation_checkpointing)
        except AttributeError:
            return bool(getattr(self.base_model, "is_gradient_checkpointing", False))

    def lora_layers(self) -> list[MultiLoRALinear]:
        """The wrapped Linears, in module order (that of ``targets``; PEFT's parameter order)."""
        return [self.base_model.get_submodule(path) for path in self.targets]

    def lora_parameters(self) -> list[nn.Parameter]:
        """Every stacked LoRA tensor (the trainable weights of all members), in module order."""
        return [p for layer in self.lora_layers() for p in (layer.lora_A, layer.lora_B)]

    def member_parameters(self, k: int) -> list[torch.Tensor]:
        """Member k's LoRA weights as views of the stacked tensors (each ``(r, in)`` / ``(out, r)``, PEFT's shapes)."""
        return [p[k] for p in self.lora_parameters()]

    # -------------------------------------------------------------------------------------------- the forward
    def resolve_members(self, members=None, adapter_names=None, rows: int | None = None) -> tuple[int, ...]:
        """The members of a call's row blocks from ``members`` (an index, a name, or a sequence of them: one per
        block) or ``adapter_names`` (one name per row; rows of one member must form contiguous blocks of one size)."""
        if (members is None) == (adapter_names is None):
            raise ValueError("a MultiLoRAModel call needs exactly one of members= and adapter_names= (which member "
                             "each block of rows runs)")
        if adapter_names is not None:
            names = list(adapter_names)
            if rows is not None and len(names) != rows:
                raise ValueError(f"adapter_names has {len(names)} entries for {rows} rows")
            runs, start = [], 0
            for i in range(1, len(names) + 1):
                if i == len(names) or names[i] != names[start]:
                    runs.append(i - start)
                    start = i
            block = math.gcd(*runs)   # blocks of one size: every run of one name is a whole number of blocks
            members = names[::block]
        if isinstance(members, (int, str)):
            members = (members,)
        out = []
        for m in members:
            if isinstance(m, str):
                if m not in self._index:
                    raise ValueError(f"unknown member {m!r}; members: {self.member_names}")
                m = self._index[m]
            if not 0 <= int(m) < self.num_members:
                raise ValueError(f"member index {m} out of range 0..{self.num_members - 1}")
            out.append(int(m))
        if not out or (rows is not None and rows % len(out)):
            raise ValueError(f"{rows} rows do not split into {len(out)} equal member blocks")
        return tuple(out)

    def forward(self, input_ids=None, attention_mask=None, *, members=None, adapter_names=None, **kwargs):
        rows = input_ids.shape[0] if input_ids is not None else kwargs["inputs_embeds"].shape[0]
        with self.routing.use(self.resolve_members(members, adapter_names, rows)):
            return self.base_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    # -------------------------------------------------------------------------------------------- checkpointing
    def _checkpoint_contexts(self):
        """``context_fn`` of torch's non-reentrant checkpoint, called at each checkpointed call: the recomputation
        runs under the routing of that call (captured now), not under whatever is set when backward runs."""
        return contextlib.nullcontext(), self.routing.use(self.routing.members)

    def checkpointing(self, on: bool) -> None:
        """Activation checkpointing of the body (non-reentrant, routing kept for the recomputation) on or off."""
        base = self.base_model
        kwargs = {"use_reentrant": False, "context_fn": self._checkpoint_contexts}
        if hasattr(base, "activation_checkpointing_enable"):   # transformers 5.24 renamed gradient_checkpointing_*
            if on:
                base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                base.activation_checkpointing_disable()
        elif on:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            base.gradient_checkpointing_disable()

    # -------------------------------------------------------------------------------------------- PEFT's format
    def save_adapters(self, directory: str | Path) -> None:
        """PEFT's layout, one folder per member: ``<member>/adapter_config.json`` + ``adapter_model.safetensors``
        (keys ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``), as ``PeftModel.save_pretrained``
        writes it; ``PeftModel.from_pretrained`` + ``load_adapter`` load it (and :func:`from_peft` converts that)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        layers = dict(zip(self.targets, self.lora_layers()))
        for k, name in enumerate(self.member_names):
            folder = directory / name
            folder.mkdir(parents=True, exist_ok=True)
            tensors = {}
            for path, layer in layers.items():
                tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"] = layer.lora_A[k].detach().cpu().contiguous()
                tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"] = layer.lora_B[k].detach().cpu().contiguous()
            save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
            config = copy.deepcopy(self.peft_configs[name])
            config.inference_mode = True
            config.save_pretrained(str(folder))

    def unwrap(self) -> nn.Module:
        """The body with its plain Linears back (in place; this model is unusable afterwards)."""
        for path in self.targets:
            parent, name = _parent(self.base_model, path)
            setattr(parent, name, getattr(parent, name).base_layer)
        self.targets = []
        return self.base_model

    def to_peft(self):
        """The same members as a PEFT model (``get_peft_model`` + ``add_adapter`` with the saved configs, then these
        weights copied in), built on this body in place: this model is unusable afterwards."""
        from peft import get_peft_model

        weights = {path: (layer.lora_A.detach(), layer.lora_B.detach())
                   for path, layer in zip(self.targets, self.lora_layers())}
        base = self.unwrap()
        peft_model = None
        for name in self.member_names:
            config = copy.deepcopy(self.peft_configs[name])
            config.inference_mode = False
            if peft_model is None:
                with quiet_peft():
                    peft_model = get_peft_model(base, config, adapter_name=name)
            else:
                peft_model.add_adapter(name, config)
        inner = peft_model.base_model.model
        with torch.no_grad():
            for path, (a, b) in weights.items():
                layer = inner.get_submodule(path)
                for k, name in enumerate(self.member_names):
                    layer.lora_A[name].weight.copy_(a[k])
                    layer.lora_B[name].weight.copy_(b[k])
        return peft_model.eval()


@contextlib.contextmanager
def quiet_peft():
    """PEFT 0.21 calls transformers' deprecated ``is_gradient_checkpointing`` (a FutureWarning per model): noise."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def from_peft(peft_model, member_names: Sequence[str]) -> MultiLoRAModel:
    """Move the adapters ``member_names`` of a PEFT LoRA model (around a headless body) into a
    :class:`MultiLoRAModel` on the same body: PEFT's layers are unloaded (the body gets its plain Linears back) and
    every targeted Linear is wrapped with the members' weights stacked. The weights keep their dtype (PEFT's float32
    on a bf16 base). Only plain LoRA converts: every member on the same Linears with the same rank, alpha and dropout
    per layer, no bias, DoRA or other variant (anything else is one clear error)."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    names = list(member_names)
    inner = peft_model.base_model.model
    layers: dict[str, dict] = {}
    for path, module in inner.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        where = f"LoRA layer {path}"
        if type(module) is not LoraLinear or type(module.base_layer) is not nn.Linear:
            raise UserError(f"{where} is a {type(module).__name__}: only LoRA on Linear layers runs batched")
        missing = [n for n in names if n not in module.lora_A]
        if missing:
            raise UserError(f"{where} has no adapter {missing[0]!r}: every member must target the same layers")
        variants = getattr(module, "lora_variant", {})   # DoRA and the other variants (PEFT >= 0.15)
        if any(n in variants or getattr(module, "use_dora", {}).get(n) for n in names) or module.fan_in_fan_out:
            raise UserError(f"{where} uses a LoRA variant (DoRA, ...) or fan_in_fan_out: not supported batched")
        if any(module.lora_B[n].bias is not None for n in names):
            raise UserError(f"{where} has a LoRA bias: not supported batched")
        scalings = {float(module.scaling[n]) for n in names}
        drops = {float(getattr(module.lora_dropout[n], "p", 0.0)) for n in names}
        shapes = {tuple(module.lora_A[n].weight.shape) for n in names}
        if len(scalings) > 1 or len(drops) > 1 or len(shapes) > 1:
            raise UserError(f"{where}: the members differ in rank, alpha or dropout ({sorted(shapes)}, scaling "
                            f"{sorted(scalings)}, dropout {sorted(drops)}); a batched ensemble needs them equal")
        layers[path] = {"A": torch.stack([module.lora_A[n].weight.detach() for n in names]),
                        "B": torch.stack([module.lora_B[n].weight.detach() for n in names]),
                        "scaling": scalings.pop(), "dropout": drops.pop()}
    if not layers:
        raise UserError("the PEFT model holds no LoRA layer")
    configs = {n: copy.deepcopy(peft_model.peft_config[n]) for n in names}
    base = peft_model.unload()   # PEFT's layers out, the plain Linears back
    return MultiLoRAModel(base, names, layers, configs)

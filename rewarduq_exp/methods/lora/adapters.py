"""LoRA adapters in PEFT's on-disk format, read from a run folder someone may have handed over.

A folder holds ``adapter_config.json`` + ``adapter_model.safetensors`` (``PeftModel.save_pretrained``'s layout).
Every file PEFT would read is checked first: a missing or cut-short file is one line naming it, before the base model
is loaded, and PEFT never falls back to the hub or to a pickled ``adapter_model.bin``. The config must describe the
LoRA of the method's hyperparameters (rank, alpha) and nothing PEFT would act on beyond it (other ranks per module,
extra modules, imports): PEFT allocates what the config says. Each tensor's declared shape must be that of the rank
and the base's Linear it belongs to.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from rewarduq_exp.core.errors import UserError, first_line, one_line
from rewarduq_exp.core.payload_bounds import Expected, check_tensors, declared_tensors
from rewarduq_exp.core.saved_files import check_finite, check_safetensors, read_json_object

PEFT_PREFIX = "base_model.model."   # PEFT's key prefix for a PeftModel around a headless body (no task type)
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"

# adapter_config.json fields that a saved adapter of ours leaves empty (null, false, {} or []): each makes PEFT
# allocate or do more than the LoRA of the hyperparameters (per-module ranks, copies of whole modules, repeated
# layers, DoRA magnitudes, trainable tokens, initialisations from the base's weights, an imported module).
# (auto_mapping, which PEFT's own save_pretrained writes, is read by AutoPeftModel only, never by PeftModel.)
ADAPTER_FIELDS_UNSET = ("rank_pattern", "alpha_pattern", "modules_to_save", "layer_replication",
                        "megatron_config", "trainable_token_indices", "target_parameters",
                        "use_dora", "use_qalora", "use_bdlora", "loftq_config", "eva_config", "corda_config",
                        "arrow_config", "lora_ga_config", "kasa_config", "monteclora_config", "velora_config",
                        "alora_invocation_tokens", "layers_to_transform", "layers_pattern", "fan_in_fan_out")


def check_adapter_config(config: dict, path: Path, rank: int, alpha: float, method: str) -> None:
    """Refuse (one line naming the file and the field) an adapter config that is not the LoRA of ``rank`` and
    ``alpha``, before PEFT reads it."""
    fix = "refused before PEFT reads it; the run folder is damaged: copy it again or retrain"

    def refuse(field: str, value, why: str):
        raise UserError(one_line(f"{path}: field \"{field}\" is {value!r}; {why}; {fix}"))

    if config.get("peft_type") != "LORA":
        refuse("peft_type", config.get("peft_type"), f"an {method} adapter is LORA")
    got_rank = config.get("r")
    if type(got_rank) is not int or got_rank != rank:
        refuse("r", got_rank, f"method.json says lora_rank={rank}")
    got_alpha = config.get("lora_alpha")
    if type(got_alpha) not in (int, float) or float(got_alpha) != alpha:
        refuse("lora_alpha", got_alpha, f"method.json says lora_alpha={alpha:g}")
    dropout = config.get("lora_dropout", 0.0)
    if type(dropout) not in (int, float) or not 0 <= dropout < 1:
        refuse("lora_dropout", dropout, "must be a number in [0, 1)")
    if config.get("bias", "none") != "none":
        refuse("bias", config.get("bias"), f"an {method} adapter has no bias")
    if type(config.get("init_lora_weights", True)) is not bool:
        refuse("init_lora_weights", config.get("init_lora_weights"), "must be true or false")
    targets = config.get("target_modules")
    if not (isinstance(targets, str) or (isinstance(targets, list) and targets
                                         and all(isinstance(t, str) for t in targets))):
        refuse("target_modules", targets, "must be a module name or a list of them")
    for field in ADAPTER_FIELDS_UNSET:
        if config.get(field) not in (None, False, {}, []):
            refuse(field, config.get(field), f"a saved {method} adapter never sets it")


def check_adapter_files(folder: Path, rank: int, alpha: float, method: str, what: str) -> None:
    """The config (:func:`check_adapter_config`) and that the weights file is a complete safetensors file."""
    config_path = folder / CONFIG
    check_adapter_config(read_json_object(config_path, what), config_path, rank, alpha, method)
    check_safetensors(folder / WEIGHTS)


def expected_adapter(base, declared: dict, rank: int, model_name: str) -> dict:
    """{tensor: Expected} of an ``adapter_model.safetensors``: for every LoRA module the file names, ``lora_A``
    (r, in_features) and ``lora_B`` (out_features, r) of the base's Linear at that path (a name that is not a Linear
    of the base is left out, so the file is refused for holding it)."""
    expected = {}
    for key in declared:
        if not key.startswith(PEFT_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            continue
        path = key[len(PEFT_PREFIX):-len(".lora_A.weight")]
        try:
            module = base.get_submodule(path)
        except AttributeError:
            continue
        if not isinstance(module, nn.Linear):
            continue
        why = f"lora_rank={rank} and the Linear {path} of model '{model_name}'"
        expected[f"{PEFT_PREFIX}{path}.lora_A.weight"] = Expected((rank, module.in_features), "f", why)
        expected[f"{PEFT_PREFIX}{path}.lora_B.weight"] = Expected((module.out_features, rank), "f", why)
    return expected


def check_adapter_shapes(base, folder: Path, rank: int, model_name: str) -> None:
    weights = folder / WEIGHTS
    check_tensors(weights, expected_adapter(base, declared_tensors(weights), rank, model_name))


def load_peft(base, folders: dict[str, Path], model_name: str):
    """A PEFT model on ``base`` with the adapter of each (name: folder), all checked before (local folders only,
    loaded as safetensors: nothing is executed)."""
    from peft import PeftModel

    from rewarduq_exp.models.multi_lora import quiet_peft

    peft_model = None
    for name, folder in folders.items():
        try:
            if peft_model is None:
                with quiet_peft():
                    peft_model = PeftModel.from_pretrained(base, str(folder), adapter_name=name)
            else:
                peft_model.load_adapter(str(folder), adapter_name=name)
        except ValueError as err:  # PEFT's NoMatchingPeftModuleError is a ValueError (its message: older PEFT)
            if "not found in the base model" not in str(err):
                raise
            raise UserError(one_line(f"{folder / CONFIG}: field \"target_modules\" names no layer of model "
                                     f"'{model_name}' ({first_line(err)}); the run folder is damaged or was trained "
                                     "on another backbone")) from None
        check_finite({n: p for n, p in peft_model.named_parameters() if f".{name}." in n and "lora_" in n},
                     folder / WEIGHTS)
    return peft_model

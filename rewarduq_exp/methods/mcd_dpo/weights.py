"""The policy's weights: the backbone checkpoint as a causal LM (refusing one without an LM head), an FSDP-sharded
model's whole weights, and the parameters to and from a training checkpoint's tensors."""

from __future__ import annotations

import torch

from rewarduq_exp.core import training_checkpoint
from rewarduq_exp.core.errors import UserError, one_line


def load_causal_lm(backbone, dtype=None):
    """The backbone checkpoint as a causal LM, refusing a sequence classifier whose LM head would be random.

    Skywork reward models are ``Qwen3ForSequenceClassification`` checkpoints: they hold the transformer body and a
    score head, no LM head. With ``tie_word_embeddings`` the LM head is the input embedding matrix (what the Qwen3
    0.6B-4B bases do); without it, ``from_pretrained`` would silently initialise a random LM head (the reference
    code's bug, notes 9.3), so that case is an error.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    backbone.require_decoder("mcd_dpo")
    config = backbone.from_pretrained(AutoConfig, "config")
    classifier = any("ForSequenceClassification" in a for a in (getattr(config, "architectures", None) or []))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if classifier and not tied:
        raise UserError(f"model '{backbone.name}' is a sequence-classifier checkpoint without tied word embeddings: "
                        "it has no LM head and cannot be used with method=mcd_dpo (use a causal LM or a checkpoint "
                        "with tie_word_embeddings=true)")
    model, info = backbone.from_pretrained(AutoModelForCausalLM, dtype=dtype or backbone.dtype,
                                           output_loading_info=True)
    missing = set(info.get("missing_keys", ()))
    head_is_embedding = model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    if classifier and not head_is_embedding:
        model.lm_head.weight = model.get_input_embeddings().weight
        head_is_embedding = True
    if "lm_head.weight" in missing and not head_is_embedding:
        raise UserError(f"model '{backbone.name}' has no LM head weights (lm_head.weight missing) and untied "
                        "embeddings: it cannot be used with method=mcd_dpo")
    return model


def full_weights(model) -> dict[str, torch.Tensor]:
    """The whole weights of an FSDP-sharded model as CPU tensors, on every process (a collective call).

    ``full_state_dict`` all-gathers every DTensor; without ``cpu_offload`` every process (not only rank 0) receives
    the result, briefly as one whole copy of the weights on the device, before it moves to the CPU.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {k: v.detach().to("cpu") for k, v in state.items()}


def _param_tensors(model) -> dict[str, torch.Tensor]:
    """The model's parameters by name (a tied LM head appears once, as the input embedding it shares)."""
    return {f"param.{name}": p.detach() for name, p in model.named_parameters()}


@torch.no_grad()
def _load_params(model, state: training_checkpoint.TrainingState) -> None:
    params = dict(model.named_parameters())
    saved = {k.removeprefix("param."): v for k, v in state.tensors.items() if k.startswith("param.")}
    if saved.keys() != params.keys():
        odd = sorted(saved.keys() ^ params.keys())[:3]
        raise UserError(one_line(f"the MCD-DPO training checkpoint does not match this model (parameters {odd} are "
                                 "in one of them only); delete the run's checkpoint folder to train from step 0"))
    for name, p in params.items():
        p.copy_(saved[name])

"""What a decoder-only transformer holds per token while it runs: the activation sizes that the planner multiplies by
a batch, and that token budgets divide the device's free memory by (:mod:`rewarduq_exp.models.token_budget`).

Sizes are counted per token and layer from what a Qwen3 decoder layer saves for backward (two RMSNorms, q/k/v with
their per-head norms and rotary embedding, attention output, the SwiGLU MLP's four I-sized tensors):
``6 d + 6 q + 6 kv + 4 I`` elements, stored in the compute dtype; the attention matrix adds ``2 heads x L`` per token
where the attention runs as a plain softmax (PyTorch's math kernel, the CPU with a padding mask) and nothing on a GPU
(flash / memory-efficient kernels). Inference keeps one layer alive: ``2 d + max(3 q + 3 kv (+ the attention
matrix), 3 I)`` per token, + the hidden states passed on. A forward that keeps its KV cache (the shared-prompt
two-pass forward of :mod:`rewarduq_exp.models.shared_prefix`) adds ``2 kv`` per token and layer.
"""

from __future__ import annotations

from rewarduq_exp.models.shapes import Architecture


def train_activation_elems(a: Architecture) -> int:
    """Elements a decoder layer saves for backward, per token (module docstring)."""
    return 6 * a.hidden + 6 * a.q_dim + 6 * a.kv_dim + 4 * a.intermediate


def attention_matrix_elems(a: Architecture, length: int, math_kernel: bool) -> int:
    return 2 * a.heads * length if math_kernel else 0


def inference_activation_elems(a: Architecture, length: int = 0, math_kernel: bool = False) -> int:
    """Elements alive at once inside one layer of a no-grad forward, per token: the layer's input and its norm, and
    the larger of the attention block (q, k, v, their normed and rotated copies, the attention matrix) and the MLP
    block (SiLU(gate), up and their product)."""
    attention = 3 * a.q_dim + 3 * a.kv_dim + attention_matrix_elems(a, length, math_kernel)
    return 2 * a.hidden + max(attention, 3 * a.intermediate)


def kv_cache_elems(a: Architecture) -> int:
    """Keys and values of every layer, per token: what a forward with ``use_cache=True`` keeps."""
    return 2 * a.layers * a.kv_dim


def training_token_bytes(a: Architecture, length: int, act_bytes: int, math_kernel: bool,
                         checkpointing: bool, residual_bytes: int | None = None) -> float:
    """Bytes kept for backward per token of a forward through every layer (sequences of ``length`` tokens);
    ``residual_bytes``: the bytes of an element of the residual stream (the layer inputs that checkpointing keeps),
    when it differs from ``act_bytes`` (float32 weights under bf16 autocast keep a float32 residual stream)."""
    per_layer = train_activation_elems(a) + attention_matrix_elems(a, length, math_kernel)
    if checkpointing:   # each layer's input kept, one layer's activations during its recomputation
        return a.layers * a.hidden * (residual_bytes or act_bytes) + per_layer * act_bytes
    return (a.layers * per_layer + 2 * a.hidden) * act_bytes


def training_activations(a: Architecture, rows: int, length: int, act_bytes: int, math_kernel: bool,
                         checkpointing: bool) -> float:
    """Bytes kept for backward by a forward of ``rows`` sequences of ``length`` tokens through every layer."""
    return rows * length * training_token_bytes(a, length, act_bytes, math_kernel, checkpointing)


def inference_token_bytes(a: Architecture, length: int, act_bytes: int, math_kernel: bool,
                          all_hidden_states: bool = False, kv_cache: bool = False) -> float:
    """Bytes alive per token at the peak of a no-grad forward (sequences of ``length`` tokens); ``kv_cache``: the
    forward keeps its keys and values (the shared-prompt passes)."""
    per_token = inference_activation_elems(a, length, math_kernel)
    kept = (a.layers + 1) * a.hidden if all_hidden_states else 2 * a.hidden
    return (per_token + kept + (kv_cache_elems(a) if kv_cache else 0)) * act_bytes


def inference_activations(a: Architecture, rows: int, length: int, act_bytes: int, math_kernel: bool,
                          all_hidden_states: bool = False, kv_cache: bool = False) -> float:
    return rows * length * inference_token_bytes(a, length, act_bytes, math_kernel, all_hidden_states, kv_cache)


def lora_training_reserved(trainable: int) -> float:
    """Bytes of a LoRA fit besides the frozen body and the activations: the float32 trainable weights' gradients,
    AdamW's two states and the anchor's initial copy (the weights themselves are allocated before the budget)."""
    return 4.0 * 4 * trainable
